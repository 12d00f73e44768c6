import pytest
import torch

from reinforge.algorithms.advantages import group_advantages, leave_one_out_baseline, mean_baseline


def test_group_advantages_match_hand_computed_values():
    """Rewards [1, 0, 0, 1]: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.577350;
    advantages = +-0.5 / 0.577350 = +-0.866025."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    advantages = group_advantages(rewards, mean_baseline, normalize_std=True)
    expected = torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_without_std_normalisation_advantages_are_reward_minus_mean():
    """Rewards [1, 0, 0, 0]: mean 0.25, so advantages [0.75, -0.25, -0.25, -0.25] (Dr.GRPO)."""
    advantages = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), mean_baseline, normalize_std=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_leave_one_out_baseline_is_mean_of_the_others():
    """Rewards [1, 0, 0, 0]: sample 0's baseline is (0+0+0)/3 = 0 -> A = 1; the others' is (1+0+0)/3 -> A = -1/3."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(leave_one_out_baseline(rewards), torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]]))
    advantages = group_advantages(rewards, leave_one_out_baseline, normalize_std=False)
    torch.testing.assert_close(advantages, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))


@pytest.mark.parametrize("baseline", [mean_baseline, leave_one_out_baseline])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_groups_with_equal_rewards_get_zero_advantage(baseline, normalize_std):
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    advantages = group_advantages(rewards, baseline, normalize_std)
    assert torch.equal(advantages, torch.zeros_like(rewards))


def test_mean_baseline_advantages_sum_to_zero_in_every_group():
    rewards = torch.rand(5, 8, generator=torch.Generator().manual_seed(0))
    advantages = group_advantages(rewards, mean_baseline, normalize_std=True)
    torch.testing.assert_close(advantages.sum(dim=1), torch.zeros(5), atol=1e-5, rtol=0)
