import math

import torch

from reinforge.algorithms.losses import (
    cispo_policy_gradient,
    clipped_policy_gradient,
    clipped_policy_loss,
    constant_normaliser,
    k3_kl,
    sequence_log_ratio,
    sequence_mean,
    token_log_ratio,
    token_mean,
)
from reinforge.data.batch import Normalisers


def test_clipped_policy_gradient_matches_hand_computed_values():
    """eps_low = eps_high = 0.2; log-ratios ln 1.5, ln 0.5, ln 1.1 with advantages +1, -1, +2:
    token 0: ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2, clipped
    token 1: ratio 0.5, A=-1: max(0.5, 0.8) = 0.8, clipped
    token 2: ratio 1.1, A=+2: max(-2.2, -2.2) = -2.2, not clipped"""
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    loss, ratio, clipped = clipped_policy_gradient(new - old, advantages, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.8, -2.2]]))
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 0.5, 1.1]]))
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]


def test_clip_higher_uses_separate_upper_bound():
    """eps_low 0.2, eps_high 0.28: ratio 1.25 with A=+1 is inside [0.8, 1.28], so loss = -1.25, not clipped."""
    loss, _, clipped = clipped_policy_gradient(torch.log(torch.tensor([[1.25]])), torch.ones(1, 1), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.25]]))
    assert clipped.item() == 0.0


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """ratio 5, A = -1, c = 3: PPO gives max(5, 1.2) = 5; dual clip caps it at -A * c = 3."""
    loss, _, clipped = clipped_policy_gradient(torch.log(torch.tensor([[5.0]])), -torch.ones(1, 1), 0.2, 0.2, 3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0]]))
    assert clipped.item() == 1.0


def test_k3_kl_matches_hand_computed_value_and_is_zero_at_equality():
    """logp = ln 0.5, logp_ref = ln 0.25: x = ln(0.25/0.5) = -ln 2; k3 = e^x - x - 1 = 0.5 + 0.693147 - 1 = 0.193147."""
    kl = k3_kl(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]))
    torch.testing.assert_close(kl, torch.tensor([[0.193147]]), atol=1e-6, rtol=0)
    same = torch.randn(2, 3)
    assert torch.equal(k3_kl(same, same), torch.zeros(2, 3))


def test_token_and_sequence_aggregation_match_hand_computed_values():
    """values [[1, 2, 3], [4, 0, 0]], mask [[1, 1, 1], [1, 0, 0]]:
    token mean = (1+2+3+4) / 4 = 2.5; sequence mean = (6/3 + 4/1) / 2 = 3."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    norm = Normalisers(num_tokens=4, num_sequences=2)
    assert token_mean(values, mask, norm).item() == 2.5
    assert sequence_mean(values, mask, norm).item() == 3.0


def test_grpo_loss_with_kl_matches_hand_computed_value():
    """Two tokens, ratio 1 (logp = old), A = +1, kl_coef 0.1, ref logprobs giving k3 = 0.193147 on token 0 and 0 on
    token 1:
    per token: -1 + 0.1 * 0.193147 = -0.980685 and -1; token mean = -0.990343."""
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    loss, metrics = clipped_policy_loss(
        logp,
        logp.clone(),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        Normalisers(2, 1),
        aggregate=token_mean,
        eps_low=0.2,
        eps_high=0.2,
        kl_coef=0.1,
        ref_logprobs_BT=ref,
    )
    torch.testing.assert_close(loss, torch.tensor(-0.990343), atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.193147 / 2), atol=1e-6, rtol=0)
    assert metrics["clip_fraction"].item() == 0.0


def test_masked_positions_never_change_the_loss():
    """Garbage in prompt and padding positions (mask 0) of every input leaves the loss unchanged."""
    gen = torch.Generator().manual_seed(0)
    logp, old, ref = (torch.randn(2, 5, generator=gen) for _ in range(3))
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
    kwargs = dict(aggregate=token_mean, eps_low=0.2, eps_high=0.2, kl_coef=0.05)
    base, _ = clipped_policy_loss(
        logp, old, torch.tensor([1.0, -1.0]), mask, Normalisers(6, 2), ref_logprobs_BT=ref, **kwargs
    )
    noise = torch.randn(2, 5, generator=gen) * 100 * (1 - mask)
    moved, _ = clipped_policy_loss(
        logp + noise,
        old - noise,
        torch.tensor([1.0, -1.0]),
        mask,
        Normalisers(6, 2),
        ref_logprobs_BT=ref + noise,
        **kwargs,
    )
    torch.testing.assert_close(base, moved)


def test_truncated_importance_weights_cap_the_train_over_gen_ratio():
    """log w = ln 3 -> w = 3, capped at C = 2; log w = ln 0.5 -> 0.5 stays."""
    from reinforge.algorithms.losses import truncated_importance_weights

    old = torch.log(torch.tensor([[3.0, 0.5]]))
    weights = truncated_importance_weights(old, torch.zeros(1, 2), cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5]]))


def test_sequence_mask_drops_sequences_whose_geometric_mean_ratio_is_out_of_bounds():
    """Row 0: log ratios [ln 4, 0] -> mean ln 2 -> ratio 2, inside [0.5, 2]: kept.
    Row 1: [ln 9, 0] -> mean ln 3 -> ratio 3: dropped. Row 2's padding position (mask 0) is ignored."""
    from reinforge.algorithms.losses import sequence_ratio_mask

    old = torch.log(torch.tensor([[4.0, 1.0], [9.0, 1.0], [1.0, 100.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    weights = sequence_ratio_mask(old, torch.zeros(3, 2), mask, low=0.5, high=2.0)
    assert weights.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


def test_importance_weights_scale_the_policy_gradient_term_only():
    """ratio 1, A = +1, weights [2, 0.5]: pg per token = [-2, -0.5]; token mean = -1.25; KL (0 here) unweighted."""
    logp = torch.zeros(1, 2)
    loss, _ = clipped_policy_loss(
        logp,
        logp.clone(),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        Normalisers(2, 1),
        aggregate=token_mean,
        eps_low=0.2,
        eps_high=0.2,
        is_weights_BT=torch.tensor([[2.0, 0.5]]),
    )
    assert loss.item() == -1.25


def test_sequence_log_ratio_is_the_mean_log_ratio_over_valid_tokens_on_every_position():
    """Row 0: log ratios [ln 2, ln 8, padding 5.0 (mask 0)] -> (ln 2 + ln 8) / 2 = ln 4, so s = 4 = (2 * 8)^(1/2).
    Row 1: one valid token with log ratio -ln 2 -> s = 0.5. Every position of a row carries its sequence's value."""
    old = torch.zeros(2, 3)
    new = torch.tensor([[math.log(2.0), math.log(8.0), 5.0], [-math.log(2.0), 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ratio = torch.exp(sequence_log_ratio(new, old, mask))
    torch.testing.assert_close(ratio, torch.tensor([[4.0, 4.0, 4.0], [0.5, 0.5, 0.5]]))
    assert torch.equal(token_log_ratio(new, old, mask), new)


def test_gspo_loss_clips_whole_sequences_and_spreads_the_gradient_over_their_tokens():
    """GSPO = clipped_policy_loss with the sequence ratio and sequence aggregation; eps 0.2 low, 0.28 high, 2 sequences.
    Sequence 0: log ratios [0.1, -0.1] -> s = exp(0) = 1, A = +1: loss term -1, unclipped.
    Sequence 1: log ratios [0.6, 0.6, 0.6] -> s = e^0.6 = 1.822119 > 1.28, A = +1: loss term -1.28, clipped.
    loss = (-1 - 1.28) / 2 = -1.14. Gradient wrt logp: sequence 0's tokens get -A * s / |y| / B = -1 * 1 / 2 / 2 = -0.25
    each; sequence 1 is clipped, so its tokens get 0. Token clip fraction 3/5."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.1, 0.0], [0.6, 0.6, 0.6]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = clipped_policy_loss(
        logp,
        old,
        torch.tensor([1.0, 1.0]),
        mask,
        Normalisers(num_tokens=5, num_sequences=2),
        aggregate=sequence_mean,
        log_ratio=sequence_log_ratio,
        eps_low=0.2,
        eps_high=0.28,
    )
    torch.testing.assert_close(loss, torch.tensor(-1.14))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(metrics["clip_fraction"], torch.tensor(0.6))
    torch.testing.assert_close(metrics["ratio_max"], torch.tensor(math.exp(0.6)))


def test_constant_normaliser_divides_the_token_sum_by_sequences_times_max_tokens():
    """values [[1, 2, 3], [4, (9), (9)]], mask [[1, 1, 1], [1, 0, 0]], 2 sequences, L = 10:
    (1 + 2 + 3 + 4) / (2 * 10) = 0.5, whatever the number of valid tokens (4) or the sequence lengths (3, 1)."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert constant_normaliser(10)(values, mask, Normalisers(num_tokens=4, num_sequences=2)).item() == 0.5


def test_micro_batch_losses_sum_to_the_global_batch_loss_for_every_variant():
    """With the global normalisers, two micro-batches of 2 sequences give the loss and the gradient of one batch of 4,
    for the token ratio with token/constant aggregation and for GSPO's sequence ratio with sequence aggregation."""
    gen = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 6, generator=gen) * 0.1, torch.randn(4, 6, generator=gen) * 0.1
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    norm = Normalisers(num_tokens=int(mask.sum()), num_sequences=4)
    variants = [
        (token_mean, token_log_ratio),
        (constant_normaliser(6), token_log_ratio),
        (sequence_mean, sequence_log_ratio),
    ]
    for aggregate, log_ratio in variants:
        kwargs = dict(aggregate=aggregate, log_ratio=log_ratio, eps_low=0.2, eps_high=0.28)
        whole_logp = logp.clone().requires_grad_(True)
        whole, _ = clipped_policy_loss(whole_logp, old, advantages, mask, norm, **kwargs)
        whole.backward()
        split_logp = logp.clone().requires_grad_(True)
        parts = [
            clipped_policy_loss(
                split_logp[s : s + 2], old[s : s + 2], advantages[s : s + 2], mask[s : s + 2], norm, **kwargs
            )[0]
            for s in (0, 2)
        ]
        sum(parts).backward()
        torch.testing.assert_close(sum(parts), whole)
        torch.testing.assert_close(split_logp.grad, whole_logp.grad)


def test_cispo_keeps_the_gradient_of_tokens_whose_weight_is_clipped():
    """eps_low 0.2, eps_high 0.28; log-ratios ln 1.5, ln 0.5, 0 with advantages +1, -1, +2 (token mean over 3):
    weights sg(clip(r)) = 1.28, 0.8, 1; loss_t = -w A log r = -1.28 x 0.405465 = -0.518995,
    -0.8 x (-1) x (-0.693147) = -0.554518, 0; d loss / d logp_t = -w A / 3 = -0.426667, +0.266667, -0.666667.
    PPO's clip gives tokens 0 and 1 no gradient at all (their clipped surrogate is constant)."""
    old = torch.zeros(1, 3)
    advantages = torch.tensor([1.0, -1.0, 2.0])

    def loss_and_gradient(policy_gradient):
        logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_()
        loss, metrics = clipped_policy_loss(
            logp,
            old,
            advantages.view(1, 3),
            torch.ones(1, 3),
            Normalisers(3, 1),
            aggregate=token_mean,
            eps_low=0.2,
            eps_high=0.28,
            policy_gradient=policy_gradient,
        )
        return loss, metrics, torch.autograd.grad(loss, logp)[0]

    loss, metrics, grad = loss_and_gradient(cispo_policy_gradient)
    assert abs(loss.item() - (-0.518995 - 0.554518) / 3) < 1e-5
    torch.testing.assert_close(grad, torch.tensor([[-0.426667, 0.266667, -0.666667]]), atol=1e-5, rtol=0)
    assert abs(metrics["clip_fraction"].item() - 2 / 3) < 1e-6
    _, _, ppo_grad = loss_and_gradient(clipped_policy_gradient)
    torch.testing.assert_close(ppo_grad, torch.tensor([[0.0, 0.0, -0.666667]]), atol=1e-5, rtol=0)


def test_per_token_advantages_weigh_each_token_on_its_own():
    """Ratio 1 everywhere (old = new), token mean over 3 valid tokens of 2 sequences: the loss is -sum A_t / 3.
    Per-token A = [[1, 2], [3, 0]] with mask [[1, 1], [1, 0]]: -(1 + 2 + 3) / 3 = -2; per-sequence A = [1, 3]
    broadcast: -(1 + 1 + 3) / 3 = -5/3."""
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    common = dict(aggregate=token_mean, eps_low=0.2, eps_high=0.2)
    per_token, _ = clipped_policy_loss(
        logp, logp, torch.tensor([[1.0, 2.0], [3.0, 0.0]]), mask, Normalisers(3, 2), **common
    )
    per_sequence, _ = clipped_policy_loss(logp, logp, torch.tensor([1.0, 3.0]), mask, Normalisers(3, 2), **common)
    assert abs(per_token.item() + 2.0) < 1e-6 and abs(per_sequence.item() + 5 / 3) < 1e-6
