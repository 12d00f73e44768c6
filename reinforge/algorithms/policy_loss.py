"""The policy loss of the RL recipes (GRPO, PPO, distillation): its config (`loss:`) and the loss function of a
micro-batch built from it, with the train/inference mismatch among its metrics. The tensor math is losses.py's."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import model_validator

from reinforge.algorithms.consistency import mismatch_contributions
from reinforge.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOG_RATIOS,
    POLICY_GRADIENTS,
    clipped_policy_loss,
    constant_normaliser,
    sequence_ratio_mask,
    truncated_importance_weights,
)
from reinforge.config.section import Section
from reinforge.data.batch import TrainBatch
from reinforge.training.base import TrainingBackend


class PolicyLossConfig(Section):
    """`loss:` the clipped policy-gradient loss of the RL recipes, its KL penalty and its correction for the
    train/inference mismatch."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy; 0 does not load the reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimate of KL(policy || reference) (Schulman 2020), with log r = logp_ref - logp: `k1` = -log r,
    `k2` = (log r)^2 / 2, `k3` = r - 1 - log r. In the loss their expected gradients differ: k1's is 0, k2's is
    that of KL(policy || reference), k3's (GRPO's choice) that of KL(reference || policy); in the reward
    (`kl_in_reward`) k1 gives that of KL(policy || reference). docs/algorithms.md derives them."""
    policy_loss: Literal["ppo_clip", "cispo"] = "ppo_clip"
    """`ppo_clip`: PPO's clipped surrogate (a clipped token gives no gradient); `cispo`: MiniMax-M1's CISPO, the
    importance weight clipped to [1 - clip_eps_low, 1 + clip_eps_high] and detached, times A log pi, so every
    token keeps a gradient (the paper sets no lower bound: clip_eps_low 1.0)."""
    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: the ratio is clipped above at 1 + clip_eps_high (0.28 is DAPO's clip-higher)."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 for negative advantages (Ye et al. 2020); null disables it."""
    is_correction: Literal["auto", "none", "token_truncate", "sequence_mask"] = "auto"
    """Importance-sampling correction for the train/inference mismatch, with w_t = exp(logp_old - logp_gen)
    (`auto`: `token_truncate` under async generation with `rollout.max_staleness` >= 1, else `none`):
    `token_truncate` multiplies each token's loss by min(w_t, is_truncate_cap) (TIS); `sequence_mask` drops
    sequences whose geometric-mean ratio exp(mean_t log w_t) is outside [is_sequence_low, is_sequence_high]."""
    is_truncate_cap: float = 2.0
    """C in TIS: the cap on the per-token importance weight."""
    is_sequence_low: float = 0.5
    """Lower bound of the sequence ratio kept by `sequence_mask`."""
    is_sequence_high: float = 2.0
    """Upper bound of the sequence ratio kept by `sequence_mask`."""
    aggregation: Literal["token", "sequence", "constant"] = "token"
    """`token`: mean over all valid tokens of the global batch; `sequence`: mean over sequences of
    each sequence's token mean; `constant`: sum over valid tokens / (sequences x `constant_normaliser_tokens`)
    (Dr.GRPO)."""
    constant_normaliser_tokens: int | None = None
    """Tokens per sequence in the `constant` aggregation's divisor; null: `generation.max_new_tokens`."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio in the clipped objective: each token's own (PPO, GRPO), or the sequence's
    exp(mean_t (logp - logp_old)) on all its tokens, clipped as one (GSPO; use with `aggregation=sequence`)."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """Where logp_old (the trainer's logprobs before the step's first update) comes from. `auto`: when the
    rollout is one optimizer step (`training.global_batch_size` >= its sequences) the policy being trained
    is the old policy, so the training pass's own logprobs, detached, are logp_old (the ratio is 1 in value
    and its gradient is the policy gradient, as in TRL), and no separate forward pass is spent on them; with
    several optimizer steps per rollout the first global batch still takes its training pass's, and the later
    ones' are computed in a pass of their own before the first update. `recompute`: that separate pass over
    every sequence (the same numbers, more forward passes)."""

    @model_validator(mode="after")
    def _check_ranges(self) -> "PolicyLossConfig":
        checks = [
            (self.clip_eps_low > 0 and self.clip_eps_high > 0, "loss.clip_eps_low and loss.clip_eps_high must be > 0"),
            (
                self.clip_eps_low < 1 or (self.policy_loss == "cispo" and self.clip_eps_low == 1),
                "loss.clip_eps_low must be < 1 so that the lower clip 1 - eps stays positive "
                "(with loss.policy_loss=cispo, 1: no lower bound)",
            ),
            (
                self.dual_clip_c is None or self.dual_clip_c > 1,
                "loss.dual_clip_c must be > 1 (or null to disable dual clip)",
            ),
            (self.kl_coef >= 0, "loss.kl_coef must be >= 0"),
            (self.is_truncate_cap > 0, "loss.is_truncate_cap must be > 0"),
            (
                0 <= self.is_sequence_low < 1 < self.is_sequence_high,
                "loss.is_sequence_low must be in [0, 1) and loss.is_sequence_high > 1",
            ),
            (
                self.constant_normaliser_tokens is None or self.constant_normaliser_tokens > 0,
                "loss.constant_normaliser_tokens must be > 0 (or null for generation.max_new_tokens)",
            ),
            (
                self.policy_loss != "cispo" or self.dual_clip_c is None,
                "loss.dual_clip_c does not apply to loss.policy_loss=cispo (its clipped weights keep their "
                "gradient); set it to null",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


class RewardKLLossConfig(PolicyLossConfig):
    """`loss:` of the recipes whose rewards may carry the KL penalty (GRPO, PPO)."""

    kl_in_reward: bool = False
    """Put the KL penalty in the reward instead of the loss (InstructGPT's PPO): each sequence's reward loses
    kl_coef x the sum of its tokens' estimates (old policy against reference, before the step's updates), so
    the penalty is normalised with the rewards and the loss has no KL term."""

    @model_validator(mode="after")
    def _check_kl_in_reward(self) -> "RewardKLLossConfig":
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError(
                "loss.kl_in_reward=true has no penalty to put in the reward with loss.kl_coef=0; set loss.kl_coef > 0"
            )
        return self


def kl_in_reward(loss: PolicyLossConfig) -> bool:
    """Whether the KL penalty is in the reward (then measured in the loss, not trained on)."""
    return isinstance(loss, RewardKLLossConfig) and loss.kl_in_reward


def importance_weights(
    loss: PolicyLossConfig, correction: str, old_logprobs_BT: torch.Tensor, micro: TrainBatch
) -> torch.Tensor | None:
    """Per-token weights correcting for the engine's sampling distribution differing from the trainer's
    (numerics, or under async generation an older policy); `correction` is `loss.is_correction` resolved."""
    if correction == "token_truncate":
        return truncated_importance_weights(old_logprobs_BT, micro.gen_logprobs, loss.is_truncate_cap)
    if correction == "sequence_mask":
        return sequence_ratio_mask(
            old_logprobs_BT, micro.gen_logprobs, micro.loss_mask, loss.is_sequence_low, loss.is_sequence_high
        )
    return None


def policy_loss_fn(loss: PolicyLossConfig, max_new_tokens: int, off_policy: bool):
    """The clipped policy-gradient loss of a micro-batch, with the engine/trainer mismatch among its metrics.
    `max_new_tokens`: the `constant` aggregation's default divisor; `off_policy`: generation may run ahead of
    training (async with staleness >= 1), which `is_correction=auto` corrects with TIS."""
    if loss.aggregation == "constant":
        aggregate = constant_normaliser(loss.constant_normaliser_tokens or max_new_tokens)
    else:
        aggregate = AGGREGATIONS[loss.aggregation]
    correction = loss.is_correction
    if correction == "auto":
        correction = "token_truncate" if off_policy else "none"
    in_reward = kl_in_reward(loss)

    def loss_fn(logprobs_BT: torch.Tensor, micro: TrainBatch, norm):
        # Without a pass of their own (loss.old_logprobs), the old policy is the one being trained: this pass's
        old_BT = logprobs_BT.detach() if micro.old_logprobs is None else micro.old_logprobs
        value, metrics = clipped_policy_loss(
            logprobs_BT,
            old_BT,
            micro.advantages,
            micro.loss_mask,
            norm,
            aggregate=aggregate,
            log_ratio=LOG_RATIOS[loss.ratio_level],
            eps_low=loss.clip_eps_low,
            eps_high=loss.clip_eps_high,
            dual_clip_c=loss.dual_clip_c,
            policy_gradient=POLICY_GRADIENTS[loss.policy_loss],
            kl_coef=0.0 if in_reward else loss.kl_coef,  # in the reward: measured (train/kl), not trained on
            kl_estimator=KL_ESTIMATORS[loss.kl_estimator],
            ref_logprobs_BT=micro.ref_logprobs,
            is_weights_BT=importance_weights(loss, correction, old_BT, micro),
        )
        return value, {**metrics, **mismatch_contributions(old_BT, micro.gen_logprobs, micro.loss_mask, norm)}

    return loss_fn


def old_policy_logprobs(trainer: TrainingBackend, batch: TrainBatch, global_batch: int, whole: bool) -> int | None:
    """Sets `batch.old_logprobs` (logp_old, `PolicyLossConfig.old_logprobs`) where the training passes cannot
    give them, computed before the first update; returns the first row they cover, None when there is no pass.
    With `whole` (the config asks for every row, or the caller needs them: the KL in the reward, the version
    check) every row's. Otherwise the rows after the first global batch's, whose old policy is trained on in
    later optimizer steps: the first global batch's is the policy its own training pass runs, and its rows
    stay 0 here (`split_old_logprobs` drops them from that global batch)."""
    if whole:
        batch.old_logprobs = trainer.logprobs(batch)
        return 0
    if len(batch) <= global_batch:
        return None
    later_BT = trainer.logprobs(batch.slice(global_batch, len(batch)))
    batch.old_logprobs = torch.zeros_like(batch.loss_mask, dtype=later_BT.dtype)
    batch.old_logprobs[global_batch:, : later_BT.shape[1]] = later_BT
    return global_batch


def split_old_logprobs(batch: TrainBatch, global_batch: int, first_row: int | None) -> list[TrainBatch]:
    """The rollout's global batches in order, each with its old logprobs, or None (its training pass's own)
    where `old_policy_logprobs` computed none for its rows."""
    parts = [batch.slice(start, start + global_batch) for start in range(0, len(batch), global_batch)]
    for start, part in zip(range(0, len(batch), global_batch), parts):
        if first_row is None or start < first_row:
            part.old_logprobs = None
    return parts
