"""Lossless async resume: an async GRPO run (generation one policy ahead of training) killed with SIGKILL at five
random moments and resumed each time trains on exactly the prompts of a run never killed: the same prompt ordinals
step by step (RUN_DIR/prompts.jsonl), none missing, none twice, with the same metrics."""

import subprocess
from collections import Counter

import pytest
from _kill import cli_command, json_rows, kill_at_random_moments

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

ARGS = [
    "loop.max_steps=6",
    "rollout.num_prompts_per_step=4",
    "rollout.mode=async",
    "rollout.max_staleness=1",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=24",
    "data.max_val_prompts=4",
    "loop.val_every=3",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "checkpoint.resume=auto",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
    "cluster.max_restarts=0",  # the test kills and resumes by hand
]


def command(run_dir):
    return cli_command("grpo", PROJECT_ROOT / "configs" / "grpo_demo.yaml", *ARGS, f"logging.run_dir={run_dir}")


def trained_prompts(run_dir) -> list[tuple[int, list[int]]]:
    return [(row["step"], row["ordinals"]) for row in json_rows(run_dir / "prompts.jsonl")]


def comparable(run_dir) -> list[dict]:
    return [
        {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))}
        for row in json_rows(run_dir / "metrics.jsonl")
    ]


def test_an_async_run_killed_at_five_random_moments_trains_on_exactly_the_prompts_of_a_run_never_killed(tmp_path):
    reference = tmp_path / "uninterrupted"
    result = subprocess.run(command(reference), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = trained_prompts(reference)
    assert [step for step, _ in expected] == [1, 2, 3, 4, 5, 6]
    assert all(len(ordinals) == 4 for _, ordinals in expected)
    assert sorted(o for _, ordinals in expected for o in ordinals) == list(range(24))  # the stream, in draws

    run = tmp_path / "killed"
    kills = kill_at_random_moments(command(run), run, reference, seed=26)
    final = subprocess.run(command(run), capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    assert kills >= 3, kills
    got = trained_prompts(run)
    ordinals = Counter(o for _, step_ordinals in got for o in step_ordinals)
    assert sorted(ordinals) == list(range(24)) and set(ordinals.values()) == {1}, ordinals  # none lost, none twice
    assert got == expected  # the same prompts at the same steps
    assert comparable(run) == comparable(reference)
