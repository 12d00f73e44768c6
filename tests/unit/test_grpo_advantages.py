"""The GRPO loop's advantages of scored trajectories (algorithms/grpo_losses.py): GDPO's components from
`env.extra_rewards` or an agent's reward_components, the KL penalty in the reward, token-weighted whitening;
and the config errors of the new loss settings."""

import pytest
import torch

from reinforge.algorithms.grpo_config import load_config
from reinforge.algorithms.grpo_losses import kl_reward_penalties, reward_components, step_advantages
from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ReinforgeError
from reinforge.paths import PROJECT_ROOT


def config(*overrides: str):
    return load_config(PROJECT_ROOT / "configs" / "grpo_demo.yaml", list(overrides))


def trajectory(reward: float, components: dict[str, float], num_tokens: int = 2, group: int = 0) -> Trajectory:
    return Trajectory(
        prompt_ids=[5],
        response_ids=[7] * num_tokens,
        gen_logprobs=[0.0] * num_tokens,
        truncated=False,
        reward=reward,
        group=group,
        task="math",
        components=components,
    )


def test_gdpo_components_are_the_task_reward_and_each_extra_reward_with_its_weight():
    assert reward_components(
        [trajectory(1.5, {"task_reward": 1.0, "format": 1.0})],
        config("env.extra_rewards={format: 0.5}").env.extra_rewards,
    ) == (["task_reward", "format"], [1.0, 0.5])


def test_gdpo_takes_an_agents_components_when_they_sum_to_the_reward_else_the_reward_alone():
    summing = [trajectory(1.0, {"accuracy": 1.0, "style": 0.0}), trajectory(0.5, {"accuracy": 0.0, "style": 0.5})]
    assert reward_components(summing, config().env.extra_rewards) == (["accuracy", "style"], [1.0, 1.0])
    parts_of_a_verdict = [trajectory(1.0, {"accuracy": 1.0, "style": 1.0})]  # 2 != 1: not the reward's parts
    assert reward_components(parts_of_a_verdict, config().env.extra_rewards) == ([], [1.0])


def test_gdpo_step_advantages_normalise_the_components_and_whiten_by_tokens():
    """One group of 2 with components (task_reward, format) = (1, 0) and (0, 1), weights 1 and 0.5, 3 and 1 trained
    tokens. Each component normalised in its group (mean 0.5, unbiased std 0.707107): task [0.707107, -0.707107],
    format [-0.707107, 0.707107]; sum with weights [0.353553, -0.353553]; token-weighted mean (3 x 0.353553 -
    0.353553) / 4 = 0.176777, var (3 x 0.176777^2 + 0.530330^2) / 4 = 0.09375, std 0.306186:
    whitened [0.577350, -1.732051]. GRPO on the summed rewards [1, 0.5] (+-0.353553 / 0.353553) then token
    whitening gives the same here; a third component would not."""
    trajectories = [
        trajectory(1.0, {"task_reward": 1.0, "format": 0.0}, 3),
        trajectory(0.5, {"task_reward": 0.0, "format": 1.0}, 1),
    ]
    batch = collate(trajectories, [0.0, 0.0], 0)
    rewards_PG = torch.tensor([[1.0, 0.5]])
    gdpo = config("env.extra_rewards={format: 0.5}", "grpo.decoupled_normalization=true")
    advantages, metrics = step_advantages(trajectories, rewards_PG, [], batch, gdpo.grpo, gdpo.env.extra_rewards)
    torch.testing.assert_close(advantages, torch.tensor([[0.577350, -1.732051]]), atol=1e-5, rtol=0)
    assert metrics == {"train/num_reward_components": 2.0}
    by_sequences = config(
        "env.extra_rewards={format: 0.5}", "grpo.decoupled_normalization=true", "grpo.whiten_over=sequences"
    )
    torch.testing.assert_close(
        step_advantages(trajectories, rewards_PG, [], batch, by_sequences.grpo, by_sequences.env.extra_rewards)[0],
        torch.tensor([[1.0, -1.0]]),
        atol=1e-5,
        rtol=0,
    )


def test_the_kl_penalty_in_the_reward_is_kl_coef_times_the_sequence_sum_of_the_estimate():
    """k1 = old - ref on the trained tokens: row 0 (-1 + 1.5) + (-2 + 1) = -0.5, row 1 (-0.5 + 0.25) = -0.25 with
    its second token masked; kl_coef 0.1: [-0.05, -0.025]. k2 = (old - ref)^2 / 2: row 0 0.125 + 0.5 = 0.625
    -> 0.0625."""
    batch = collate([trajectory(0.0, {}), trajectory(0.0, {})], [0.0, 0.0], 0)
    batch.loss_mask[1, 2] = 0.0
    batch.old_logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -3.0]])
    batch.ref_logprobs = torch.tensor([[0.0, -1.5, -1.0], [0.0, -0.25, -1.0]])
    k1 = kl_reward_penalties(batch, config("loss.kl_in_reward=true", "loss.kl_coef=0.1", "loss.kl_estimator=k1").loss)
    torch.testing.assert_close(k1, torch.tensor([-0.05, -0.025]))
    k2 = kl_reward_penalties(batch, config("loss.kl_in_reward=true", "loss.kl_coef=0.1", "loss.kl_estimator=k2").loss)
    assert abs(k2[0].item() - 0.0625) < 1e-6
    assert torch.equal(kl_reward_penalties(batch, config().loss), torch.zeros(2))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.policy_loss=cispo", "loss.dual_clip_c=3"], "loss.dual_clip_c does not apply to loss.policy_loss=cispo"),
        (["loss.kl_in_reward=true", "loss.kl_coef=0"], "loss.kl_in_reward=true has no penalty to put in the reward"),
        (["grpo.decoupled_normalization=true", "grpo.whiten_advantages=true"], "already whitens the advantages"),
        (["loss.clip_eps_low=1.0"], "loss.clip_eps_low must be < 1"),
        (["loss.kl_estimator=k4"], "loss.kl_estimator"),
    ],
)
def test_bad_loss_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ReinforgeError, match=message) as raised:
        config(*overrides)
    assert "\n" not in str(raised.value)


def test_cispo_takes_no_lower_bound():
    assert config("loss.policy_loss=cispo", "loss.clip_eps_low=1.0").loss.clip_eps_low == 1.0
