"""GRPO with generation.backend=vllm, as a user runs it: the reward rises, the engine stays consistent."""

import json
import subprocess
import sys

from reinforge.paths import PROJECT_ROOT


def test_grpo_with_vllm_raises_reward_and_logs_refit_and_consistency(tmp_path):
    command = [
        sys.executable, "-m", "reinforge.cli", "grpo", "--config", PROJECT_ROOT / "configs" / "grpo_demo.yaml",
        "generation.backend=vllm", "grpo.max_steps=12", "grpo.val_every=0", f"logging.run_dir={tmp_path / 'run'}",
    ]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = rows[1:]
    assert len(steps) == 12
    for row in steps:
        assert row["train/token_mult_prob_error"] <= 1.05
        assert row["timing/refit_s"] > 0
    early = sum(r["train/reward_mean"] for r in steps[:4]) / 4
    late = sum(r["train/reward_mean"] for r in steps[-4:]) / 4
    assert late > early, (early, late)
    assert rows[-1]["val/accuracy"] >= rows[0]["val/accuracy"] + 0.05, (rows[0]["val/accuracy"], rows[-1]["val/accuracy"])
