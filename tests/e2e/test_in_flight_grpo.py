"""In-flight GRPO end to end (`rollout.mode=in_flight`) on the demo, with the HF engine (waves, the KV cache kept)
and with vLLM (continuous batching, the cache recomputed): refits land while groups are being generated, so some
sequences span two policy versions; no token is older than `rollout.max_staleness` allows; no prompt is trained
twice; the token metrics are logged each step; and the engine's logprobs still agree with the trainer's (with
`rollout.version_check`, each token's with the weights of the version that sampled it)."""

import json
import subprocess
import sys

import pytest
from _kill import cli_command, kill_at_random_moments

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

ARGS = [
    "rollout.mode=in_flight",
    "rollout.num_prompts_per_step=8",
    "training.global_batch_size=64",
    "training.micro_batch_size=64",
    "data.max_val_prompts=8",
    "loop.val_every=0",
    "checkpoint.save_final=false",
]


def run(run_dir, *extra, config="grpo_demo.yaml"):
    command = [
        *(sys.executable, "-m", "reinforge.cli", "grpo", "--config", str(PROJECT_ROOT / "configs" / config)),
        *ARGS,
        *extra,
        f"logging.run_dir={run_dir}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    return [row for row in rows if row["step"] > 0], prompts


@pytest.mark.parametrize(
    "engine",
    [
        ("generation.backend=hf", "loop.max_steps=6"),
        (
            "generation.backend=vllm",
            "loop.max_steps=5",
            "rollout.in_flight_kv_cache=recompute",
            "rollout.version_check=true",
        ),
    ],
    ids=["hf", "vllm"],
)
def test_in_flight_grpo_spans_updates_within_the_staleness_bound_and_trains_each_prompt_once(tmp_path, engine):
    steps, prompts = run(tmp_path / "run", *engine)
    assert max(row["rollout/spanning_update_fraction"] for row in steps) > 0  # tokens of two versions in a sequence
    assert all(row["rollout/token_staleness_max"] <= 1 for row in steps)  # rollout.max_staleness=1 (the default)
    assert all(row["rollout/versions_per_sequence_mean"] >= 1 for row in steps)
    assert all(0 <= row["generation/idle_fraction"] <= 1 for row in steps)
    assert all(row["train/token_mult_prob_error"] < 1.05 for row in steps)
    if "rollout.version_check=true" in engine:  # every token against the weights of the version that sampled it
        assert all(row["train/version_matched/token_share"] == 1.0 for row in steps)
        assert all(row["train/version_matched/token_mult_prob_error"] < 1.05 for row in steps)
    ordinals = [ordinal for row in prompts for ordinal in row["ordinals"]]
    assert len(ordinals) == len(set(ordinals)) == 8 * len(steps)


def test_agent_episodes_in_flight_span_updates_and_are_all_recorded(tmp_path):
    """The agent demo in flight: every prompt group is a rollout session of the endpoint of its own, open at once;
    every episode is rebuilt from the endpoint's record (none failed, none left unclaimed), tokens of older versions
    are trained, each token matches the version that sampled it, and each prompt is trained once."""
    steps, prompts = run(
        tmp_path / "run", "loop.max_steps=4", "rollout.max_staleness=2", "rollout.version_check=true",
        config="grpo_agent_demo.yaml",
    )  # fmt: skip
    # a step's agent metrics are those of the groups finished since the step before (none on some steps)
    counted = [row for row in steps if "rollout/agent_episodes" in row]
    assert sum(row["rollout/agent_episodes"] for row in counted) >= 8 * 8 * len(steps)  # every trained episode
    assert all(row["rollout/agent_ok_fraction"] == 1.0 for row in counted)
    assert all(row["rollout/agent_unclaimed_calls"] == 0 for row in counted)
    assert 1 <= max(row["rollout/token_staleness_max"] for row in steps) <= 2  # tokens of older versions trained
    # each token against the weights of the version that sampled it, through the endpoint's per-call versions
    assert all(row["train/version_matched/token_share"] == 1.0 for row in steps)
    assert all(row["train/version_matched/token_mult_prob_error"] < 1.05 for row in steps)
    ordinals = [ordinal for row in prompts for ordinal in row["ordinals"]]
    assert len(ordinals) == len(set(ordinals)) == 8 * len(steps)


def test_an_in_flight_run_killed_at_three_random_moments_loses_no_prompt_and_trains_none_twice(tmp_path):
    """Which groups finish first depends on timing, so the prompts of each step are not those of another run; what
    must hold: every prompt drawn is trained once, or is still owed (finished or to be generated again) in the last
    checkpoint."""
    from reinforge.training.checkpoint import load_driver_state

    run_dir = tmp_path / "run"
    args = [*ARGS, "loop.max_steps=6", "rollout.num_prompts_per_step=4", "training.global_batch_size=32"]
    args += ["training.micro_batch_size=32", "checkpoint.save_every=1", "checkpoint.resume=auto"]
    args += ["cluster.max_restarts=0", "generation.max_new_tokens=24"]
    command = cli_command("grpo", PROJECT_ROOT / "configs" / "grpo_demo.yaml", *args, f"logging.run_dir={run_dir}")
    reference = subprocess.run([*command[:-1], f"logging.run_dir={tmp_path / 'uninterrupted'}"], timeout=600)
    assert reference.returncode == 0
    kills = kill_at_random_moments(command, run_dir, tmp_path / "uninterrupted", seed=29)
    final = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    assert kills >= 3, kills
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in prompts] == [1, 2, 3, 4, 5, 6]
    trained = [ordinal for row in prompts for ordinal in row["ordinals"]]
    assert len(trained) == len(set(trained)) == 24  # none twice
    last = load_driver_state(run_dir / "checkpoints" / "step_00000006")
    (pending,) = last["pending_rollouts"]
    owed = [ordinal for ordinal, *_ in pending.ready] + [ordinal for ordinal, _ in pending.redo]
    assert last["sampler"]["epoch"] == 0  # the demo's training prompts are not all drawn: ordinal = position
    drawn = last["sampler"]["position"]
    assert sorted(trained + owed) == list(range(drawn))  # none lost
