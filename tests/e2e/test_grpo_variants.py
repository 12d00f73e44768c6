"""Every GRPO-family config (configs/<method>_demo.yaml) runs 2 steps on the demo model with the real engine,
trainer and verifier, logs finite metrics, and logs what is specific to its method."""

import json
import math

import pytest

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.paths import PROJECT_ROOT

COMMON = [
    "train/reward_mean",
    "train/loss",
    "train/pg_loss",
    "train/clip_fraction",
    "train/grad_norm",
    "train/advantage_mean",
    "train/advantage_std",
    "rollout/gen_len_mean",
    "timing/step_s",
]

# method -> (overrides beyond the small shared ones, metrics only that method logs);
# GDPO: tests/e2e/test_reasoning_control.py
VARIANTS = {
    # answers of the demo model are ~30 tokens: a 32-token limit truncates most (in step 2 here, all of them),
    # so overlong filtering has work to do
    "dapo": (
        ["generation.max_new_tokens=32"],
        [
            "rollout/dynamic_sampling_rounds",
            "rollout/num_dropped_groups",
            "rollout/dropped_group_fraction",
            "rollout/num_trained_groups",
            "rollout/overlong_penalty_mean",
            "rollout/overlong_filtered_fraction",
        ],
    ),
    "gspo": ([], []),
    "dr_grpo": ([], []),
    "rloo": (["training.global_batch_size=64"], []),  # one on-policy optimizer step per rollout, as in the config
    "reinforce_pp": ([], []),
    "cispo": ([], []),  # 64 samples, 2 optimizer steps: the second one's ratios leave 1
}
ONLY_DAPO = VARIANTS["dapo"][1]


@pytest.mark.parametrize("method", list(VARIANTS))
def test_each_grpo_variant_config_trains_two_steps_with_finite_metrics(method, tmp_path):
    overrides, specific = VARIANTS[method]
    config = load_config(
        PROJECT_ROOT / "configs" / f"{method}_demo.yaml",
        # one torch thread: on a shared 2-core machine, two threads per process wait on each other (6x slower)
        [
            "loop.max_steps=2",
            "loop.val_every=0",
            "data.max_val_prompts=16",
            "rollout.num_prompts_per_step=8",
            "training.global_batch_size=32",
            "training.micro_batch_size=32",
            "generation.num_probe_prompts=2",
            "cluster.num_threads=1",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )
    result = loops.train(config)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert all(math.isfinite(value) for value in row.values()), row
        missing = [key for key in specific if key not in row]
        if row.get("rollout/overlong_filtered_fraction") == 1.0:  # every answer truncated: nothing to train on
            assert row["train/num_optimizer_steps"] == 0 and "train/loss" not in row
        else:
            missing += [key for key in COMMON if key not in row]
        assert not missing, missing
        if method != "dapo":
            assert not set(ONLY_DAPO) & set(row), "dynamic sampling and overlong metrics appear only when they are on"
        check_method(method, row, config)
    assert math.isfinite(result.last_val_accuracy)


def check_method(method: str, row: dict[str, float], config) -> None:
    """What each method's settings must show in a step's metrics."""
    if method == "dapo":
        assert row["rollout/num_trained_groups"] <= config.rollout.num_prompts_per_step
        assert 1 <= row["rollout/dynamic_sampling_rounds"] <= 1 + config.grpo.dynamic_sampling_max_extra_rounds
        assert row["train/zero_std_group_fraction"] == 0.0  # every trained group has unequal rewards
        assert -1.0 <= row["rollout/overlong_penalty_mean"] <= 0.0
        assert row["rollout/overlong_filtered_fraction"] == row["rollout/truncated_fraction"]
    if method == "reinforce_pp":  # whitened over the batch's trained tokens
        assert abs(row["train/advantage_token_mean"]) < 1e-5 and abs(row["train/advantage_token_std"] - 1.0) < 1e-3
        assert row["train/kl"] >= 0.0  # k2
    if method == "cispo":
        assert row["train/num_optimizer_steps"] == 2
    if method == "rloo":
        assert row["train/num_optimizer_steps"] == 1 and row["train/clip_fraction"] == 0.0  # on-policy: the ratio is 1
    # GSPO and Dr.GRPO change only the loss; tests/unit/test_variant_configs.py checks the loss their configs build


def test_a_kl_penalty_in_the_reward_is_zero_until_the_policy_moves(tmp_path):
    """loss.kl_in_reward with k1: at step 1 the old policy is the reference, so every penalty is exactly 0;
    at step 2 (after two updates) it is not."""
    config = load_config(
        PROJECT_ROOT / "configs" / "grpo_demo.yaml",
        [
            "loop.max_steps=2",
            "loop.val_every=0",
            "data.val_path=null",
            "rollout.num_prompts_per_step=8",
            "training.global_batch_size=32",
            "training.micro_batch_size=32",
            "generation.num_probe_prompts=2",
            "cluster.num_threads=1",
            "checkpoint.save_final=false",
            "loss.kl_in_reward=true",
            "loss.kl_coef=0.05",
            "loss.kl_estimator=k1",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    rows = [json.loads(line) for line in (loops.train(config).run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["train/kl_reward_penalty_mean"] == 0.0  # train/kl is not: it is measured during the updates
    assert rows[1]["train/kl_reward_penalty_mean"] != 0.0 and math.isfinite(rows[1]["train/kl_reward_penalty_mean"])
