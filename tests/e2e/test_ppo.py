"""PPO end to end on the demo model (reinforge ppo, configs/ppo_demo.yaml): the critic learns to explain the
returns while the policy trains, a PPO run killed after step 2 resumes to the metrics of a run never killed
(the critic restored from its checkpoint), and what PPO does not support is a one-line error."""

import json
import sys

import pytest
from _kill import assert_resumes_like_a_run_never_killed
from torch.distributed.checkpoint import FileSystemReader

from reinforge import loops
from reinforge.algorithms.ppo_config import PPORunConfig
from reinforge.cli import main
from reinforge.config.loader import load_recipe_config
from reinforge.paths import PROJECT_ROOT
from reinforge.training.state import model_state_dict

CONFIG = PROJECT_ROOT / "configs" / "ppo_demo.yaml"


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ppo_fits_the_critic_and_trains_the_policy_with_the_kl_penalty_in_the_reward(tmp_path):
    config = load_recipe_config(
        PPORunConfig,
        CONFIG,
        [
            "loss.kl_in_reward=true",
            "ppo.critic_epochs=2",
            "loop.max_steps=8",
            "loop.val_every=0",
            "rollout.num_prompts_per_step=16",
            "training.global_batch_size=128",
            "training.micro_batch_size=128",
            "data.max_val_prompts=32",
            "generation.num_probe_prompts=2",
            "cluster.num_threads=1",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = loops.train(config)
    steps = rows(result.run_dir)[1:]
    assert [row["step"] for row in steps] == list(range(1, 9))
    assert (
        steps[0]["train/explained_variance"] == 0.0 and steps[0]["train/rollout_value_mean"] == 0.0
    )  # a new critic values 0
    # the critic learns the returns' level (a zero critic's loss is 0.5 E[R^2]; one at their mean, 0.5 Var(R))
    late_value_loss = sum(row["train/value_loss"] for row in steps[-3:]) / 3
    assert late_value_loss < 0.8 * steps[0]["train/value_loss"], [row["train/value_loss"] for row in steps]
    assert all(row["train/num_optimizer_steps"] == 1 and row["train/critic_num_optimizer_steps"] == 2 for row in steps)
    assert all(
        abs(row["train/token_mult_prob_error"] - 1) < 1e-3 for row in steps
    )  # the actor trained, the engine refitted
    assert all(0 <= row["train/value_clip_fraction"] <= 1 and row["train/kl"] >= 0 for row in steps)
    # the penalty is 0 while the policy is the reference, then grows as it moves away
    assert steps[0]["train/kl_reward_penalty_mean"] == 0 and all(
        row["train/kl_reward_penalty_mean"] > 0 for row in steps[1:]
    )
    assert 0 <= result.last_val_accuracy <= 1


RESUME = [
    "loop.max_steps=4",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "checkpoint.resume=auto",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=40",
    "data.max_val_prompts=8",
    "loop.val_every=2",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
    "ppo.critic_warmup_steps=1",
]


def command(run_dir):
    return [
        sys.executable,
        "-m",
        "reinforge.cli",
        "ppo",
        "--config",
        str(CONFIG),
        *RESUME,
        f"logging.run_dir={run_dir}",
    ]


def test_a_ppo_run_killed_after_step_2_resumes_to_the_metrics_of_a_run_never_killed(tmp_path):
    """With one warm-up step of the critic alone; the critic's weights and AdamW state are in every checkpoint."""
    steps = assert_resumes_like_a_run_never_killed(command, tmp_path, step=2)[1:]
    assert (
        steps[0]["train/num_optimizer_steps"] == 0 and "train/loss" not in steps[0]
    )  # warm-up: the policy is not trained
    assert (
        all(row["train/critic_num_optimizer_steps"] == 4 for row in steps)
        and steps[1]["train/num_optimizer_steps"] == 1
    )
    critic = tmp_path / "killed" / "checkpoints" / "step_00000004" / "critic"
    assert "value_head.weight" in model_state_dict(critic)
    saved = FileSystemReader(str(critic)).read_metadata().state_dict_metadata
    assert any(name.startswith("optimizer.state.value_head.weight.") for name in saved)  # and its AdamW state


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=8", "reinforge ppo does not train LoRA adapters yet"),
        ("rollout.mode=async", "reinforge ppo is on-policy only"),
        ("ppo.lam=1.5", "ppo.lam"),
    ],
)
def test_what_ppo_does_not_support_is_one_line_before_any_run_directory(tmp_path, capsys, override, message):
    run_dir = tmp_path / "run"
    here = "cluster.max_restarts=0"  # in this process, not a supervised child (as tests/e2e/test_cli.py)
    assert main(["ppo", "--config", str(CONFIG), override, here, f"logging.run_dir={run_dir}"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("reinforge: error: ") and message in error[0], error
    assert not run_dir.exists()
