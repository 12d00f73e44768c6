"""`reinforge report` on a real GRPO run of the demo model: every figure the run's metrics allow, and a
summary whose numbers are the run's."""

import json
import os
import subprocess
import sys

import pytest
from _kill import cli_command, run_here

from reinforge.paths import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "configs" / "grpo_demo.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def reinforge(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Three GRPO steps of 16 prompts x 8 answers, validating on 16 prompts before and after each."""
    tmp = tmp_path_factory.mktemp("report")
    result = run_here(  # in this process (no interpreter start-up); the report through the real command line
        cli_command(
            "grpo",
            CONFIG,
            "loop.max_steps=3",
            "loop.val_every=1",
            "data.max_val_prompts=16",
            "rollout.num_prompts_per_step=16",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp / 'run'}",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


def test_report_of_a_grpo_run_has_every_figure_and_the_runs_numbers(run_dir):
    result = reinforge("report", str(run_dir), cwd=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    report = run_dir / "report"
    written = result.stdout.splitlines()
    assert {
        str(report / name)
        for name in [
            "reward.png",
            "val_accuracy.png",
            "loss.png",
            "kl.png",
            "entropy.png",
            "gen_length.png",
            "token_mult_prob_error.png",
            "tokens_per_s.png",
            "step_time.png",
        ]
    } <= set(written)
    assert written[-1] == str(report / "summary.md")
    for png in report.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, png.name

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [row["val/accuracy"] for row in rows]
    rewards = [row["train/reward_mean"] for row in rows[1:]]
    summary = (report / "summary.md").read_text()
    assert "3 training steps (last step 3)" in summary
    assert '| `model.name_or_path` | "models/demo" |' in summary
    assert "| `rollout.num_prompts_per_step` | 16 |" in summary
    best = max(val)
    assert f"| `val/accuracy` | {val[0]:.4g} | {val[-1]:.4g} | {best:.4g} | {val.index(best)} |" in summary
    assert f"| `train/reward_mean` | {rewards[0]:.4g} | {rewards[-1]:.4g} | {max(rewards):.4g} |" in summary
    generate_s = sum(row["timing/generate_s"] for row in rows[1:])
    total_s = sum(
        row.get("timing/step_s", 0.0) + row.get("timing/val_s", 0.0) for row in rows
    )  # step 0: validation only
    assert f"| generate | {generate_s:.1f} s | {100 * generate_s / total_s:.1f}% |" in summary
    assert f"| **total** | **{total_s:.1f} s** | 100% | |" in summary
