"""PPO's critic-side math (algorithms/ppo_losses.py) against hand-computed values."""

import pytest
import torch

from reinforge.algorithms.ppo_losses import (
    clipped_value_loss,
    explained_variance,
    gae,
    masked_mean_std,
    terminal_rewards,
    whiten_tokens,
)
from reinforge.data.batch import Normalisers


def test_gae_on_four_tokens_matches_the_hand_computed_recursion():
    """One row: 2 prompt tokens, 4 generated tokens, 1 padding; reward 1 on the last generated token;
    V = [0.5, 0.6, 0.7, 0.8] on the four actions; gamma = 0.9, lambda = 0.5 (gamma * lambda = 0.45).
        delta_3 = 1 + 0.9 * 0   - 0.8 = 0.2      A_3 = 0.2
        delta_2 = 0 + 0.9 * 0.8 - 0.7 = 0.02     A_2 = 0.02 + 0.45 * 0.2    = 0.11
        delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03     A_1 = 0.03 + 0.45 * 0.11   = 0.0795
        delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04     A_0 = 0.04 + 0.45 * 0.0795 = 0.075775
    returns R = A + V = [0.575775, 0.6795, 0.81, 1.0]; prompt and padding positions are 0."""
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 9.0, 0.5, 0.6, 0.7, 0.8, 9.0]])  # off-mask values must not be read
    rewards = terminal_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(advantages, torch.tensor([[0.0, 0.0, 0.075775, 0.0795, 0.11, 0.2, 0.0]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.0, 0.0, 0.575775, 0.6795, 0.81, 1.0, 0.0]]), atol=1e-6)


def test_gae_with_lambda_and_gamma_one_is_the_final_reward_minus_each_value():
    """veRL's defaults (gamma = lambda = 1): A_t = R - V(s_t), and every return is the reward R = 1."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[0.0, 0.5, 0.6, 0.7, 0.8]])
    advantages, returns = gae(terminal_rewards(torch.tensor([1.0]), mask), values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[0.0, 0.5, 0.4, 0.3, 0.2]]))
    assert torch.allclose(returns, torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]]))


def test_gae_skips_environment_tokens_inside_an_answer():
    """An answer whose tokens 2-3 came from the environment (mask 0) gives the advantages of the same four
    actions laid end to end: the gap adds no step (the first test's numbers)."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.0, 0.5, 0.6, 3.0, 3.0, 0.7, 0.8]])
    advantages, returns = gae(terminal_rewards(torch.tensor([1.0]), mask), values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(advantages, torch.tensor([[0.0, 0.075775, 0.0795, 0.0, 0.0, 0.11, 0.2]]), atol=1e-6)
    assert torch.allclose(returns[0, [1, 2, 5, 6]], torch.tensor([0.575775, 0.6795, 0.81, 1.0]), atol=1e-6)


def test_a_row_with_no_generated_token_gets_no_reward_and_no_advantage():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    rewards = terminal_rewards(torch.tensor([2.0, 5.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    advantages, returns = gae(rewards, torch.ones(2, 3), mask, gamma=1.0, lam=1.0)
    assert advantages[1].tolist() == [0.0, 0.0, 0.0] and returns[1].tolist() == [0.0, 0.0, 0.0]


def test_clipped_value_loss_by_hand():
    """eps_v = 0.5, V_old = 1 on both tokens, so V_clip = clamp(V, 0.5, 1.5).
    token 0: V = 2, R = 1.5: (V - R)^2 = 0.25, (V_clip - R)^2 = (1.5 - 1.5)^2 = 0    -> 0.5 * 0.25 = 0.125, not clipped
    token 1: V = 2, R = 3:   (V - R)^2 = 1,    (V_clip - R)^2 = (1.5 - 3)^2 = 2.25   -> 0.5 * 2.25 = 1.125, clipped
    token mean over 2 tokens: (0.125 + 1.125) / 2 = 0.625; clip fraction 1/2; dloss/dV = [(2 - 1.5) / 2, 0] = [0.25, 0]
    (the clipped token's loss is constant in V). Without clipping: (0.125 + 0.5) / 2 = 0.3125."""
    values = torch.tensor([[2.0, 2.0]], requires_grad=True)
    old, returns, mask = torch.tensor([[1.0, 1.0]]), torch.tensor([[1.5, 3.0]]), torch.ones(1, 2)
    norm = Normalisers(num_tokens=2, num_sequences=1)
    loss, metrics = clipped_value_loss(values, old, returns, mask, norm, clip=0.5)
    loss.backward()
    assert loss.item() == pytest.approx(0.625)
    assert metrics["value_clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["value_mean"].item() == pytest.approx(2.0)
    assert values.grad.tolist() == [[pytest.approx(0.25), 0.0]]
    unclipped, metrics = clipped_value_loss(values, old, returns, mask, norm, clip=None)
    assert unclipped.item() == pytest.approx(0.3125) and metrics["value_clip_fraction"].item() == 0.0


def test_value_loss_of_micro_batches_sums_to_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(6, 5, generator=gen) for _ in range(3))
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    norm = Normalisers(num_tokens=int(mask.sum()), num_sequences=6)
    whole, _ = clipped_value_loss(values, old, returns, mask, norm, clip=0.2)
    parts = sum(
        clipped_value_loss(values[s : s + 2], old[s : s + 2], returns[s : s + 2], mask[s : s + 2], norm, clip=0.2)[0]
        for s in range(0, 6, 2)
    )
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_whitening_and_explained_variance_use_the_valid_tokens_only():
    """Valid returns [1, 2, 3, 4] (mean 2.5, population variance 1.25); values [1, 2, 3, 3] leave residuals
    [0, 0, 0, 1] (variance 0.1875): explained variance 1 - 0.1875 / 1.25 = 0.85. A constant critic at the
    returns' mean explains 0; padding (value 100) changes nothing. Whitening divides by the Bessel-corrected
    std sqrt(5 / 3) (variance 1.25 * 4 / 3): the first token -1.5 / sqrt(5 / 3) = -1.16190."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    assert explained_variance(
        returns, torch.tensor([[1.0, 2.0, 100.0], [3.0, 3.0, 100.0]]), mask
    ).item() == pytest.approx(0.85)
    assert explained_variance(returns, torch.full((2, 3), 2.5), mask).item() == pytest.approx(0.0)
    whitened = whiten_tokens(returns, mask)
    mean, std = masked_mean_std(whitened, mask)  # population std of the whitened tokens: sqrt(3 / 4)
    assert mean.item() == pytest.approx(0.0, abs=1e-6) and std.item() == pytest.approx(0.75**0.5, abs=1e-5)
    assert whitened[:, 2].tolist() == [0.0, 0.0]
    assert whitened[0, 0].item() == pytest.approx(-1.5 / (5 / 3) ** 0.5, abs=1e-5)


def test_whitening_divides_by_the_bessel_corrected_std_with_eps_inside_the_square_root():
    """Valid tokens [1, 3] (padding 50): mean 2, Bessel-corrected variance ((1 - 2)^2 + (3 - 2)^2) / (2 - 1) = 2,
    so [-1, 1] / sqrt(2 + 1e-8) = [-0.70711, 0.70711] (the population std 1 would give [-1, 1]).
    Valid [0, 2e-4]: mean 1e-4, variance 2 * (1e-4)^2 / 1 = 2e-8; with eps 1e-8 inside the root
    1e-4 / sqrt(3e-8) = 1 / sqrt(3) = 0.57735 (eps added to the std would give 1e-4 / (1.41421e-4 + 1e-8) = 0.70706).
    One valid token: x - mean = 0, so 0 (not 0 / 0)."""
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    whitened = whiten_tokens(torch.tensor([[1.0, 50.0], [3.0, 50.0]]), mask)
    torch.testing.assert_close(whitened, torch.tensor([[-(0.5**0.5), 0.0], [0.5**0.5, 0.0]]))
    tiny = whiten_tokens(torch.tensor([[0.0, 2e-4]]), torch.ones(1, 2))
    torch.testing.assert_close(tiny, torch.tensor([[-(3**-0.5), 3**-0.5]]), atol=1e-5, rtol=0)
    assert whiten_tokens(torch.tensor([[7.0, 9.0]]), torch.tensor([[1.0, 0.0]])).tolist() == [[0.0, 0.0]]
