"""Policy-gradient losses as pure tensor functions.

Shapes: B sequences, T positions. `logprobs_BT[b, t]` is log p(token t | tokens < t); `mask_BT` is 1 on
the positions that are trained on (response tokens) and 0 on prompt and padding.

The normaliser is an explicit argument, fixed for the whole global batch (one optimizer step): with a
global token count, the sum of the micro-batch losses equals the loss of the whole batch, so gradient
accumulation (and, later, data parallelism) gives the same gradient as one big batch.

The clipped policy objective of the RL recipes (`clipped_policy_loss`; per token, to be minimised):
    ratio = exp(logp - logp_old)                      (per token; or GSPO's sequence ratio
                                                       exp(mean_t (logp - logp_old)) on all its tokens)
    pg    = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
                                                      (PPO clip, Schulman et al. 2017; eps_high > eps_low is
                                                       DAPO's clip-higher)
    pg    = min(pg, -A * c)   where A < 0, if dual clip c > 1                              (Ye et al. 2020)
    or, CISPO (MiniMax-M1, arXiv:2506.13585): pg = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * log ratio
    kl    = k(logp, logp_ref): k1, k2 or k3           (Schulman 2020; default
                                                       k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1)
    pg    = w * pg   with optional importance weights w for train/inference mismatch (TIS or a sequence mask)
    loss  = aggregate(pg + kl_coef * kl)
A is each token's advantage [B, T]: a sequence's own on all its tokens (GRPO), or per token (PPO's GAE,
distillation); a [B] tensor is taken as one per sequence. Which gradient
each KL estimator gives, as a loss term or as a reward penalty, is derived in docs/algorithms.md.
Deviation from the GRPO paper (Shao et al. 2024): the paper averages per sequence then per group ("sequence" aggregation
here); the default is DAPO's token-level mean, which does not down-weight long answers. Dr.GRPO's
aggregation divides the token sum by a constant (sequences x a fixed token budget) instead.
"""

from __future__ import annotations

from typing import Callable

import torch

from reinforge.data.batch import Normalisers

Aggregate = Callable[[torch.Tensor, torch.Tensor, Normalisers], torch.Tensor]


def token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor, norm: Normalisers) -> torch.Tensor:
    """Sum over valid tokens / number of valid tokens in the global batch."""
    return (values_BT * mask_BT).sum() / max(norm.num_tokens, 1)


def metric_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor, norm: Normalisers) -> torch.Tensor:
    """A per-token metric's contribution to its mean over the valid tokens computed in the global batch
    (`token_mean` unless sequences were left out)."""
    return (values_BT * mask_BT).sum() / max(norm.metric_tokens, 1)


def sequence_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor, norm: Normalisers) -> torch.Tensor:
    """Each sequence's mean over its valid tokens, summed, / number of sequences in the global batch."""
    per_sequence_B = (values_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
    return per_sequence_B.sum() / max(norm.num_sequences, 1)


def constant_normaliser(max_tokens_per_sequence: int) -> Aggregate:
    """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): sum over valid tokens / (number of sequences in the global
    batch x max_tokens_per_sequence). The divisor does not depend on how long the answers are, so neither a
    sequence's length nor the batch's token count rescales a token's gradient (a sum of sequence
    log-likelihoods, as in REINFORCE, up to that constant)."""

    def aggregate(values_BT: torch.Tensor, mask_BT: torch.Tensor, norm: Normalisers) -> torch.Tensor:
        return (values_BT * mask_BT).sum() / (max(norm.num_sequences, 1) * max_tokens_per_sequence)

    return aggregate


AGGREGATIONS: dict[str, Aggregate] = {"token": token_mean, "sequence": sequence_mean}


LogRatio = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def token_log_ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """PPO/GRPO: each token's own log importance ratio, logp - logp_old."""
    return logprobs_BT - old_logprobs_BT


def sequence_log_ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): log s_i = mean over the sequence's valid tokens of
    (logp - logp_old), i.e. s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), put on every position of the row.
    Its gradient reaches every token of the sequence with weight 1/|y_i|, so clipping s_i keeps or drops
    the whole sequence."""
    mean_B = ((logprobs_BT - old_logprobs_BT) * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
    return mean_B.unsqueeze(1).expand_as(logprobs_BT)


LOG_RATIOS: dict[str, LogRatio] = {"token": token_log_ratio, "sequence": sequence_log_ratio}


def clipped_policy_gradient(
    log_ratio_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss of the ratio exp(log_ratio_BT). Returns (loss_BT, ratio_BT, clipped_BT)
    where `clipped_BT` is 1 where a clip bound (not the raw ratio) set the loss, i.e. where the token gives no
    gradient."""
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1.0 - eps_low, 1.0 + eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    was_clipped_BT = clipped_BT > unclipped_BT
    if dual_clip_c is not None:
        dual_BT = -advantages_BT * dual_clip_c
        dual_active_BT = (advantages_BT < 0) & (loss_BT > dual_BT)
        loss_BT = torch.where(dual_active_BT, dual_BT, loss_BT)
        was_clipped_BT = was_clipped_BT | dual_active_BT
    return loss_BT, ratio_BT, was_clipped_BT.to(loss_BT.dtype)


def cispo_policy_gradient(
    log_ratio_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4): loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log r_t.
    The importance weight is clipped and detached, so every token keeps the gradient -clip(r_t) A_t grad log pi_t,
    a clipped one too (PPO's clip zeroes it). log r_t = log pi_t - log pi_old_t differs from the paper's
    log pi_t by a constant, so the gradient is the paper's; the value is 0 at r = 1. The paper sets no lower
    bound (a large eps_low: 1.0 makes it 0). Returns (loss_BT, ratio_BT, clipped_BT), `clipped_BT` 1 where a
    bound set the weight (those tokens still give a gradient). Dual clip does not apply."""
    assert dual_clip_c is None, "CISPO has no dual clip"
    ratio_BT = torch.exp(log_ratio_BT)
    weight_BT = torch.clamp(ratio_BT, 1.0 - eps_low, 1.0 + eps_high).detach()
    was_clipped_BT = (weight_BT != ratio_BT.detach()).to(log_ratio_BT.dtype)
    return -weight_BT * advantages_BT * log_ratio_BT, ratio_BT, was_clipped_BT


PolicyGradient = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
POLICY_GRADIENTS: dict[str, PolicyGradient] = {"ppo_clip": clipped_policy_gradient, "cispo": cispo_policy_gradient}


# --- KL estimators (Schulman 2020, "Approximating KL divergence"), per token of a sample y ~ policy --------
# With log r = logp_ref - logp, each is an estimate of KL(policy || reference) = E_policy[-log r]:
#   k1 = -log r              unbiased, can be negative
#   k2 = (log r)^2 / 2       biased (low variance), non-negative
#   k3 = r - 1 - log r       unbiased, non-negative
# As a loss term (differentiated), their expected gradients differ (docs/algorithms.md): k1's is 0, k2's is
# that of KL(policy || reference), k3's that of KL(reference || policy). As a reward penalty (not
# differentiated, `loss.kl_in_reward`), k1 gives the gradient of KL(policy || reference).


def k1_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """logp - logp_ref: unbiased for KL(policy || reference); as a loss its expected gradient is 0."""
    return logprobs_BT - ref_logprobs_BT


def k2_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """(logp - logp_ref)^2 / 2: as a loss its expected gradient is exactly that of KL(policy || reference)."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT) ** 2


def k3_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative per-token estimate of KL(policy || reference) from samples of the policy; as a
    loss its expected gradient is that of KL(reference || policy)."""
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl}


def truncated_importance_weights(
    old_logprobs_BT: torch.Tensor, gen_logprobs_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
    w_t = min(exp(logp_old - logp_gen), cap), correcting for tokens sampled by an engine whose
    distribution differs slightly from the trainer's."""
    return torch.exp(old_logprobs_BT - gen_logprobs_BT).clamp(max=cap)


def sequence_ratio_mask(
    old_logprobs_BT: torch.Tensor, gen_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Per-token weights [B, T] that are 1 for sequences whose geometric-mean ratio
    exp(mean_t (logp_old - logp_gen)) lies in [low, high], else 0 (the whole sequence is dropped)."""
    mean_log_ratio_B = ((old_logprobs_BT - gen_logprobs_BT) * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
    ratio_B = torch.exp(mean_log_ratio_B)
    keep_B = ((ratio_B >= low) & (ratio_B <= high)).to(mask_BT.dtype)
    return keep_B.unsqueeze(1).expand_as(mask_BT)


def clipped_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    norm: Normalisers,
    *,
    aggregate: Aggregate,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs_BT: torch.Tensor | None = None,
    is_weights_BT: torch.Tensor | None = None,
    log_ratio: LogRatio = token_log_ratio,
    policy_gradient: PolicyGradient = clipped_policy_gradient,
    kl_estimator: KLEstimator = k3_kl,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss of one micro-batch (GRPO's, PPO's actor's, distillation's), scaled so that
    micro-batch losses sum to the global-batch loss.
    `advantages`: [B] (one per sequence, GRPO) or [B, T] (one per token: PPO's GAE, distillation). GSPO is this
    loss with `log_ratio=sequence_log_ratio` and `aggregate=sequence_mean`; CISPO with
    `policy_gradient=cispo_policy_gradient`.

    Returns the loss and metric contributions that also sum over micro-batches (metric means divide by
    `norm.metric_tokens`), except `ratio_max`/`ratio_min`, which reduce by max/min.
    """
    advantages_BT = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand_as(logprobs_BT)
    pg_BT, ratio_BT, clipped_BT = policy_gradient(
        log_ratio(logprobs_BT, old_logprobs_BT, mask_BT), advantages_BT, eps_low, eps_high, dual_clip_c
    )
    if is_weights_BT is not None:  # importance-sampling correction of the policy-gradient term only
        pg_BT = pg_BT * is_weights_BT
    per_token_BT = pg_BT
    kl_BT = torch.zeros_like(pg_BT)
    assert kl_coef == 0 or ref_logprobs_BT is not None, "kl_coef > 0 needs reference logprobs"
    if ref_logprobs_BT is not None:  # measured even when not trained on (a KL penalty in the reward)
        kl_BT = kl_estimator(logprobs_BT, ref_logprobs_BT)
    if kl_coef > 0:
        per_token_BT = pg_BT + kl_coef * kl_BT
    loss = aggregate(per_token_BT, mask_BT, norm)
    valid = mask_BT > 0
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "pg_loss": aggregate(pg_BT, mask_BT, norm).detach(),
            "kl": metric_mean(kl_BT.detach(), mask_BT, norm),
            "clip_fraction": metric_mean(clipped_BT, mask_BT, norm),
            "ratio_mean": metric_mean(ratio_BT.detach(), mask_BT, norm),
            "ratio_max": ratio_BT[valid].max() if valid.any() else ratio_BT.new_tensor(1.0),
            "ratio_min": ratio_BT[valid].min() if valid.any() else ratio_BT.new_tensor(1.0),
        }
    return loss, metrics


# --- Preference losses: reward models and DPO -------------------------------------------------
# Pairs, not tokens: the normaliser is the number of pairs in the global batch, so micro-batch losses
# and their metrics sum to the global-batch values.


def sequence_logprobs(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) of each sequence [B]: the sum of its valid (reply) tokens' logprobs."""
    return (logprobs_BT * mask_BT).sum(dim=1)


def bradley_terry_loss(
    chosen_rewards_B: torch.Tensor, rejected_rewards_B: torch.Tensor, num_pairs: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry pairwise loss (Bradley & Terry 1952; the reward-model loss of Ouyang et al. 2022,
    arXiv:2203.02155):  loss = -(1 / num_pairs) sum_i log sigmoid(r_chosen_i - r_rejected_i).

    Metric contributions, each a sum over this micro-batch's pairs / num_pairs: `loss`, `reward_margin`
    (r_c - r_r), `preference_accuracy` (1 where r_c > r_r, 1/2 on a tie, so equal rewards score chance),
    `chosen_reward`, `rejected_reward`."""
    margins_B = chosen_rewards_B - rejected_rewards_B
    loss = -torch.nn.functional.logsigmoid(margins_B).sum() / num_pairs
    with torch.no_grad():
        wins_B = (margins_B > 0).float() + 0.5 * (margins_B == 0).float()
        metrics = {
            "loss": loss.detach(),
            "reward_margin": margins_B.sum() / num_pairs,
            "preference_accuracy": wins_B.sum() / num_pairs,
            "chosen_reward": chosen_rewards_B.sum() / num_pairs,
            "rejected_reward": rejected_rewards_B.sum() / num_pairs,
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def dpo_loss(
    chosen_logps_B: torch.Tensor,
    rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    num_pairs: int,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's sigmoid loss (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): Bradley-Terry on the implicit
    rewards r = beta * (log pi(y|x) - log pi_ref(y|x)) of sequence logprobs (sums over reply tokens):

        loss = -(1 / num_pairs) sum_i log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

    Metrics: those of `bradley_terry_loss` on the implicit rewards, plus `chosen_logp` and
    `rejected_logp`, the policy's mean sequence logprobs (both falling is DPO's known failure mode)."""
    chosen_rewards_B = beta * (chosen_logps_B - ref_chosen_logps_B)
    rejected_rewards_B = beta * (rejected_logps_B - ref_rejected_logps_B)
    loss, metrics = bradley_terry_loss(chosen_rewards_B, rejected_rewards_B, num_pairs)
    metrics["chosen_logp"] = chosen_logps_B.detach().sum() / num_pairs
    metrics["rejected_logp"] = rejected_logps_B.detach().sum() / num_pairs
    return loss, metrics
