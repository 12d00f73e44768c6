"""Async GRPO end to end (engine in a Ray actor, generating while the trainer trains): with rollout.max_staleness=0
its metrics equal the synchronous run's exactly. At max_staleness=1 every batch after the first is one policy behind,
and a run killed with SIGKILL (after a checkpoint, and at random moments) resumes to the same prompts and metrics as a
run never killed: tests/e2e/test_async_resume.py, in one run of its kills."""

import json
import subprocess
import sys

import pytest

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

ARGS = [
    "loop.max_steps=4",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=32",
    "data.max_val_prompts=8",
    "loop.val_every=2",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
]


def command(run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "reinforge.cli",
        "grpo",
        "--config",
        str(PROJECT_ROOT / "configs" / "grpo_demo.yaml"),
        *ARGS,
        *extra,
        f"logging.run_dir={run_dir}",
    ]


def run(run_dir, *extra):
    result = subprocess.run(command(run_dir, *extra), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def test_async_with_staleness_0_equals_the_synchronous_run(tmp_path):
    synchronous = run(tmp_path / "sync")
    asynchronous = run(tmp_path / "async", "rollout.mode=async", "rollout.max_staleness=0")
    assert comparable(asynchronous) == comparable(synchronous)
    assert [row["rollout/policy_lag"] for row in asynchronous[1:]] == [0, 0, 0, 0]
    assert (tmp_path / "async" / "placement.json").is_file()  # the engine really ran as a Ray actor
