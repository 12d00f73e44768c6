"""GRPO with generation.backend=vllm, as a user runs it: the reward rises, the engine stays consistent,
and a run resumed from a checkpoint continues exactly as the uninterrupted run did."""

import json
import shutil
import subprocess
import sys

import pytest

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")


def test_grpo_with_vllm_raises_reward_and_logs_refit_and_consistency(tmp_path):
    command = [
        sys.executable,
        "-m",
        "reinforge.cli",
        "grpo",
        "--config",
        PROJECT_ROOT / "configs" / "grpo_demo.yaml",
        "generation.backend=vllm",
        "loop.max_steps=12",
        "loop.val_every=0",
        "checkpoint.save_every=8",
        "checkpoint.keep_last=0",
        "checkpoint.resume=auto",
    ]
    rows = run(command, tmp_path / "run")
    steps = rows[1:]
    assert len(steps) == 12
    for row in steps:
        assert row["train/token_mult_prob_error"] <= 1.05
        assert row["timing/refit_s"] > 0
    early = sum(r["train/reward_mean"] for r in steps[:4]) / 4
    late = sum(r["train/reward_mean"] for r in steps[-4:]) / 4
    assert late > early, (early, late)
    assert rows[-1]["val/accuracy"] >= rows[0]["val/accuracy"] + 0.05, (
        rows[0]["val/accuracy"],
        rows[-1]["val/accuracy"],
    )

    # A crash after step 8's checkpoint: the same run directory without what came after it. The same
    # command resumes from step 8 (a fresh engine refitted with the checkpoint's weights) and must
    # recompute steps 9-12 exactly.
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / "run", crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_00000012")
    shutil.rmtree(crashed / "final")
    resumed = run(command, crashed)
    assert [comparable(r) for r in resumed] == [comparable(r) for r in rows]


def run(command, run_dir):
    result = subprocess.run(
        list(map(str, command + [f"logging.run_dir={run_dir}"])), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))}
