"""The preference losses (DPO, Bradley-Terry) against hand-computed values."""

import math

import torch

from reinforge.algorithms.losses import bradley_terry_loss, dpo_loss, sequence_logprobs


def test_sequence_logprobs_sum_only_the_reply_tokens():
    """rows [0, -1, -2, 9] and [0, -0.5, 7, 7] with masks [0, 1, 1, 0] and [0, 1, 0, 0]: -1 - 2 = -3 and -0.5."""
    logprobs = torch.tensor([[0.0, -1.0, -2.0, 9.0], [0.0, -0.5, 7.0, 7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert sequence_logprobs(logprobs, mask).tolist() == [-3.0, -0.5]


def test_dpo_loss_matches_hand_computed_values():
    """beta = 0.5, two pairs:
    pair 1: pi_c = -1, pi_r = -3, ref_c = -2, ref_r = -2: r_c = 0.5 * (-1 + 2) = 0.5, r_r = 0.5 * (-3 + 2) = -0.5,
            margin 1.0, -log sigmoid(1) = log(1 + e^-1) = 0.313262
    pair 2: pi_c = -4, pi_r = -2, ref_c = -3, ref_r = -4: r_c = 0.5 * (-4 + 3) = -0.5, r_r = 0.5 * (-2 + 4) = 1.0,
            margin -1.5, -log sigmoid(-1.5) = log(1 + e^1.5) = 1.701413
    loss = (0.313262 + 1.701413) / 2 = 1.007337; reward_margin = (1 - 1.5) / 2 = -0.25; accuracy 1/2;
    chosen_reward = (0.5 - 0.5) / 2 = 0; rejected_reward = (-0.5 + 1) / 2 = 0.25;
    chosen_logp = (-1 - 4) / 2 = -2.5; rejected_logp = (-3 - 2) / 2 = -2.5.
    d loss / d pi_c(pair 1) = -beta * sigmoid(-margin) / num_pairs = -0.5 * sigmoid(-1) / 2 = -0.067235."""
    chosen = torch.tensor([-1.0, -4.0], requires_grad=True)
    loss, metrics = dpo_loss(
        chosen, torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -3.0]), torch.tensor([-2.0, -4.0]), 2, beta=0.5
    )
    torch.testing.assert_close(loss, torch.tensor(1.007337), atol=1e-6, rtol=0)
    expected = {
        "loss": 1.007337,
        "reward_margin": -0.25,
        "preference_accuracy": 0.5,
        "chosen_reward": 0.0,
        "rejected_reward": 0.25,
        "chosen_logp": -2.5,
        "rejected_logp": -2.5,
    }
    assert {name: round(float(value), 6) for name, value in metrics.items()} == expected
    loss.backward()
    torch.testing.assert_close(chosen.grad[0], torch.tensor(-0.067235), atol=1e-6, rtol=0)


def test_dpo_loss_is_log_2_and_accuracy_one_half_when_the_policy_is_the_reference():
    """All implicit rewards are 0: loss = -log sigmoid(0) = log 2 = 0.693147; every pair is a tie, worth 1/2."""
    logps = torch.tensor([-3.0, -7.0, -1.5])
    loss, metrics = dpo_loss(logps, logps - 1, logps, logps - 1, 3, beta=0.1)
    torch.testing.assert_close(loss, torch.tensor(math.log(2)))
    assert metrics["preference_accuracy"].item() == 0.5
    assert metrics["reward_margin"].item() == 0.0


def test_bradley_terry_loss_matches_hand_computed_values():
    """r_c = [2, 0], r_r = [1, 0.5]: margins 1 and -0.5; -log sigmoid(1) = 0.313262,
    -log sigmoid(-0.5) = log(1 + e^0.5) = 0.974077;
    loss = (0.313262 + 0.974077) / 2 = 0.643669; reward_margin = 0.25; accuracy 1/2; chosen 1.0, rejected 0.75."""
    loss, metrics = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5]), 2)
    assert {name: round(float(value), 6) for name, value in metrics.items()} == {
        "loss": 0.643669,
        "reward_margin": 0.25,
        "preference_accuracy": 0.5,
        "chosen_reward": 1.0,
        "rejected_reward": 0.75,
    }
    torch.testing.assert_close(loss, torch.tensor(0.643669), atol=1e-6, rtol=0)


def test_micro_batch_losses_with_the_global_pair_count_sum_to_the_whole_batch_loss():
    """Gradient accumulation: two halves, each divided by the global number of pairs (4), add up to the
    loss and the gradient of all four pairs at once; so do the metrics."""
    gen = torch.Generator().manual_seed(0)
    chosen, rejected, ref_chosen, ref_rejected = (torch.randn(4, generator=gen) for _ in range(4))
    whole_input = chosen.clone().requires_grad_(True)
    whole, whole_metrics = dpo_loss(whole_input, rejected, ref_chosen, ref_rejected, 4, beta=0.3)
    whole.backward()
    parts_input = chosen.clone().requires_grad_(True)
    summed_metrics = {}
    for rows in (slice(0, 1), slice(1, 4)):
        part, metrics = dpo_loss(parts_input[rows], rejected[rows], ref_chosen[rows], ref_rejected[rows], 4, beta=0.3)
        part.backward()
        for name, value in metrics.items():
            summed_metrics[name] = summed_metrics.get(name, 0.0) + value
    torch.testing.assert_close(parts_input.grad, whole_input.grad)
    for name, value in whole_metrics.items():
        torch.testing.assert_close(summed_metrics[name], value)
