"""Lossless async resume: an async GRPO run (generation one policy ahead of training, the batch generated ahead kept
in each checkpoint) killed with SIGKILL at three random moments and once right after a checkpoint, and resumed each
time, trains on exactly the prompts of a run never killed: the same prompt ordinals step by step
(RUN_DIR/prompts.jsonl), none missing, none twice, with the same metrics. (At rollout.max_staleness=0 an async run
equals the synchronous one: tests/e2e/test_async_grpo.py.)"""

import subprocess
from collections import Counter

import pytest
from _kill import cli_command, json_rows, kill_at_random_moments, kill_once_step_checkpointed

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


def newest_checkpoint(run_dir) -> int:
    """The newest complete checkpoint's step (0 without one)."""
    return max((int(path.parent.name[5:]) for path in run_dir.glob("checkpoints/step_*/COMPLETE")), default=0)


def test_an_async_run_killed_at_random_moments_and_after_a_checkpoint_trains_on_the_prompts_of_a_run_never_killed(
    tmp_path,
):
    reference = tmp_path / "uninterrupted"
    result = subprocess.run(command(reference), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = trained_prompts(reference)
    assert [step for step, _ in expected] == [1, 2, 3, 4, 5, 6]
    assert all(len(ordinals) == 4 for _, ordinals in expected)
    assert sorted(o for _, ordinals in expected for o in ordinals) == list(range(24))  # the stream, in draws
    steps = [row for row in json_rows(reference / "metrics.jsonl") if row["step"] > 0]
    assert [row["rollout/policy_version"] for row in steps] == [0, 0, 1, 2, 3, 4]  # one policy behind
    # IS correction on: the engine's policy is the trainer's at step 1 only
    assert [abs(row["train/is_ratio_mean"] - 1.0) > 1e-5 for row in steps] == [False] + [True] * 5

    run = tmp_path / "killed"
    kills = kill_at_random_moments(command(run), run, reference, seed=26)
    assert kills >= 3, kills
    # and once as soon as a checkpoint, holding the batch generated ahead, is complete (the last step has none ahead)
    after = newest_checkpoint(run) + 1
    assert after <= 5, after
    kill_once_step_checkpointed(command(run), run, after)
    final = subprocess.run(command(run), capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"resumed from step_{after:08d}" in final.stdout
    got = trained_prompts(run)
    ordinals = Counter(o for _, step_ordinals in got for o in step_ordinals)
    assert sorted(ordinals) == list(range(24)) and set(ordinals.values()) == {1}, ordinals  # none lost, none twice
    assert got == expected  # the same prompts at the same steps
    assert comparable(run) == comparable(reference)
