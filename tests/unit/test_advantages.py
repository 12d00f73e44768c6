import pytest
import torch

from reinforge.algorithms.advantages import (
    batch_whiten,
    decoupled_advantages,
    group_advantages,
    informative_groups,
    leave_one_out_baseline,
    mean_baseline,
    overlong_penalty,
)


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


def test_batch_whitening_uses_the_mean_and_std_of_the_whole_batch():
    """REINFORCE++-baseline: rewards [[1, 0], [1, 1], [0, 0], [1, 0]] minus their group means give
    [[0.5, -0.5], [0, 0], [0, 0], [0.5, -0.5]]; batch mean 0, population variance (4 * 0.25) / 8 = 0.125,
    std = 0.353553; whitened = +-0.5 / 0.353553 = +-1.414214 (and 0 stays 0)."""
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    advantages = batch_whiten(group_advantages(rewards, mean_baseline, normalize_std=False))
    r = 1.414214
    torch.testing.assert_close(advantages, torch.tensor([[r, -r], [0.0, 0.0], [0.0, 0.0], [r, -r]]), atol=1e-5, rtol=0)
    assert abs(advantages.mean().item()) < 1e-6 and abs(advantages.std(unbiased=False).item() - 1) < 1e-5


def test_batch_whitening_subtracts_the_batch_mean():
    """[[1, 2], [3, 6]]: mean 3, deviations [-2, -1, 0, 3], population variance (4 + 1 + 0 + 9) / 4 = 3.5,
    std 1.870829: whitened [-1.069045, -0.534522, 0, 1.603567]."""
    whitened = batch_whiten(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    torch.testing.assert_close(whitened, torch.tensor([[-1.069045, -0.534522], [0.0, 1.603567]]), atol=1e-5, rtol=0)


def test_informative_groups_are_those_whose_rewards_are_not_all_equal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]


def test_overlong_penalty_follows_dapo_soft_overlong_punishment():
    """L_max = 20, L_cache = 8, so the buffer is lengths 13..20:
    |y| = 5, 12 (<= L_max - L_cache = 12): 0;  |y| = 13: (12 - 13) / 8 = -0.125;  |y| = 16: -4/8 = -0.5;
    |y| = 20 (= L_max): -8/8 = -1;  |y| = 21, 30 (> L_max): -1."""
    lengths = torch.tensor([5, 12, 13, 16, 20, 21, 30])
    penalty = overlong_penalty(lengths, max_length=20, buffer_length=8)
    assert penalty.tolist() == [0.0, 0.0, -0.125, -0.5, -1.0, -1.0, -1.0]


def test_token_whitening_weighs_each_sequence_by_its_tokens():
    """A = [1, -1] over 3 and 1 valid tokens: mean = (3 - 1) / 4 = 0.5, var = (3 x 0.5^2 + 1 x 1.5^2) / 4 = 0.75,
    std 0.866025: whitened [0.5, -1.5] / 0.866025 = [0.577350, -1.732051]. By sequences: mean 0, std 1, [1, -1].
    A sequence with no valid token counts for nothing."""
    advantages = torch.tensor([[1.0, -1.0]])
    by_tokens = batch_whiten(advantages, num_tokens_PG=torch.tensor([[3, 1]]))
    torch.testing.assert_close(by_tokens, torch.tensor([[0.577350, -1.732051]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(batch_whiten(advantages), torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)
    with_empty = batch_whiten(torch.tensor([[1.0, -1.0, 7.0]]), num_tokens_PG=torch.tensor([[3, 1, 0]]))
    torch.testing.assert_close(with_empty[:, :2], by_tokens, atol=1e-5, rtol=0)


def test_gdpo_normalises_each_component_in_its_group_before_summing():
    """One group of 4, correctness c = [1, 1, 0, 0] and format f = [0, 1, 1, 1], weights 1 and 1.
    GRPO on the sum [1, 2, 1, 1] gives samples 0 (correct, unformatted), 2 and 3 (wrong, formatted) the same advantage.
    GDPO: c has mean 0.5, unbiased std sqrt(4 x 0.25 / 3) = 0.577350: [0.866025, 0.866025, -0.866025, -0.866025];
    f has mean 0.75, unbiased std sqrt((0.5625 + 3 x 0.0625) / 3) = 0.5: [-1.5, 0.5, 0.5, 0.5];
    sum [-0.633975, 1.366025, -0.366025, -0.366025], mean 0, population std sqrt(2.535898 / 4) = 0.796226:
    whitened [-0.796226, 1.715633, -0.459701, -0.459701]."""
    c, f = torch.tensor([[1.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    grpo = group_advantages(c + f, mean_baseline, normalize_std=True)
    assert grpo[0, 0] == grpo[0, 2] == grpo[0, 3]
    gdpo = decoupled_advantages(torch.stack([c, f]), torch.tensor([1.0, 1.0]), mean_baseline)
    torch.testing.assert_close(gdpo, torch.tensor([[-0.796226, 1.715633, -0.459701, -0.459701]]), atol=1e-5, rtol=0)


def test_gdpo_weights_scale_each_normalised_component_and_one_component_is_grpo_whitened():
    """Weight 0 on f leaves c's normalised advantages [0.866, 0.866, -0.866, -0.866], whitened to [1, 1, -1, -1];
    one component alone is its group advantage, whitened."""
    c, f = torch.tensor([[1.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(
        decoupled_advantages(torch.stack([c, f]), torch.tensor([1.0, 0.0]), mean_baseline),
        torch.tensor([[1.0, 1.0, -1.0, -1.0]]),
        atol=1e-5,
        rtol=0,
    )
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0]])
    torch.testing.assert_close(
        decoupled_advantages(rewards[None], torch.tensor([1.0]), mean_baseline),
        batch_whiten(group_advantages(rewards, mean_baseline, normalize_std=True)),
    )
