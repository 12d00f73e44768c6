"""The advantages of one step's scored groups, as the GRPO loop trains on them: the rewards plus their shaping
terms (DAPO's overlong penalty, `overlong.*`; the KL penalty with `loss.kl_in_reward`), normalised per group, summed
first (GRPO) or per component (GDPO, `grpo.decoupled_normalization`), then optionally whitened over the
batch (REINFORCE++), by tokens or by sequences (`grpo.whiten_over`). The tensor math is advantages.py's.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from reinforge.algorithms.advantages import (
    BASELINES,
    batch_whiten,
    decoupled_advantages,
    group_advantages,
    overlong_penalty,
)
from reinforge.algorithms.losses import KL_ESTIMATORS
from reinforge.algorithms.policy_loss import PolicyLossConfig, kl_in_reward
from reinforge.config.section import Section
from reinforge.data.batch import TrainBatch, Trajectory


class GRPOConfig(Section):
    """`grpo:` GRPO's group-relative advantages and the choices of its family (RLOO, Dr.GRPO, REINFORCE++, GDPO,
    DAPO's dynamic sampling)."""

    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group baseline: the group mean, or the mean of the other samples (RLOO)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward standard deviation (GRPO); false for Dr.GRPO."""
    whiten_advantages: bool = False
    """After the group baseline, normalise the advantages by the mean and standard deviation of the whole
    batch, all groups together (REINFORCE++'s global advantage normalisation)."""
    whiten_over: Literal["tokens", "sequences"] = "tokens"
    """What the batch whitening (and GDPO's) averages over: every valid token, each carrying its sequence's
    advantage (REINFORCE++'s paper and reference implementations), or each sequence once."""
    decoupled_normalization: bool = False
    """GDPO (arXiv:2601.05242): normalise each reward component within its group, sum them with their weights,
    then whiten the sum over the batch, instead of normalising the summed reward. The components are the
    task reward and each of `env.extra_rewards` (with their weights), or else an agent's `reward_components`
    when they sum to its reward; a trajectory without them is one component (GRPO, whitened)."""
    skip_zero_advantage: bool = True
    """Leave sequences whose advantage is exactly 0 (groups whose rewards are all equal), and those with no
    token to train on (overlong filtering), out of the training pass when `loss.kl_coef` is 0: their loss
    is 0 whatever the policy, so they add nothing to the gradient.
    The loss still divides by the whole batch's counts, so the update is the same (up to float summation
    order); metric means (entropy, clip fraction, mismatch) are then over the sequences trained on."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (they have no advantage) and roll out
    further batches of `rollout.num_prompts_per_step` prompts until that many groups remain; the surplus is
    discarded."""
    dynamic_sampling_max_extra_rounds: int = Field(default=4, ge=0)
    """Most extra rollout rounds per step under dynamic sampling; when they are used up the step trains on
    the groups it has (fewer than `rollout.num_prompts_per_step`; none: the step is skipped)."""

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        if self.decoupled_normalization and self.whiten_advantages:
            raise ValueError(
                "grpo.decoupled_normalization (GDPO) already whitens the advantages over the batch; "
                "set grpo.whiten_advantages=false"
            )
        return self


class OverlongConfig(Section):
    """`overlong:` DAPO's treatment of answers that reach the length limit (GRPO and PPO)."""

    buffer_tokens: int = Field(default=0, ge=0)
    """L_cache of DAPO's soft overlong punishment: a reward penalty growing linearly from 0 to -1 over the
    last L_cache tokens before `generation.max_new_tokens` (L_max); single-turn only; 0 disables it."""
    filtering: bool = False
    """DAPO's overlong filtering: truncated answers (no stop before `generation.max_new_tokens`) are masked
    out of the loss; their rewards still count in their group's baseline."""


def check_overlong(overlong: OverlongConfig, max_new_tokens: int, max_turns: int) -> None:
    """The overlong buffer against the length limit it sits under (a root validator calls this)."""
    if overlong.buffer_tokens > max_new_tokens:
        raise ValueError(
            f"overlong.buffer_tokens={overlong.buffer_tokens} must be in [0, generation.max_new_tokens="
            f"{max_new_tokens}]: the buffer is the last tokens before the length limit (0 disables the penalty)"
        )
    if overlong.buffer_tokens and max_turns != 1:
        raise ValueError(
            "overlong.buffer_tokens > 0 needs rollout.max_turns=1: L_max is generation.max_new_tokens, a per-turn "
            "limit, so a multi-turn answer would be punished for its number of turns; set overlong.buffer_tokens=0"
        )


def overlong_penalties(trajectories: list[Trajectory], overlong: OverlongConfig, max_new_tokens: int) -> torch.Tensor:
    """DAPO's soft overlong punishment of each single-turn trajectory [N] on its number of generated tokens
    (zeros when `overlong.buffer_tokens` is 0)."""
    if not overlong.buffer_tokens:
        return torch.zeros(len(trajectories))
    lengths = torch.tensor([len(t.response_ids) for t in trajectories])
    return overlong_penalty(lengths, max_new_tokens, overlong.buffer_tokens)


def kl_reward_penalties(batch: TrainBatch, loss: PolicyLossConfig) -> torch.Tensor:
    """With `loss.kl_in_reward`, each sequence's penalty [B] = kl_coef x the sum over its trained tokens of the
    KL estimate of the old policy against the reference (not differentiated: a reward); else zeros."""
    if not kl_in_reward(loss):
        return torch.zeros(len(batch))
    kl_BT = KL_ESTIMATORS[loss.kl_estimator](batch.old_logprobs, batch.ref_logprobs)
    return loss.kl_coef * (kl_BT * batch.loss_mask).sum(dim=1)


def reward_components(trajectories: list[Trajectory], extra_rewards: dict[str, float]) -> tuple[list[str], list[float]]:
    """The named parts of the reward that GDPO normalises one by one, with their weights: the task reward and
    each `env.extra_rewards` environment (reward = task_reward + sum of weight x extra), or else the
    components every trajectory has when they sum to its reward (an agent's `reward_components`), or else
    the reward alone."""
    extras = extra_rewards
    if extras:
        return ["task_reward", *extras], [1.0, *extras.values()]
    names = sorted(set.intersection(*(set(t.components) for t in trajectories)))
    if names and all(abs(sum(t.components[name] for name in names) - t.reward) <= 1e-6 for t in trajectories):
        return names, [1.0] * len(names)
    return [], [1.0]


def step_advantages(
    trajectories: list[Trajectory],
    rewards_PG: torch.Tensor,
    shaping_PG: list[torch.Tensor],
    batch: TrainBatch,
    grpo: GRPOConfig,
    extra_rewards: dict[str, float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages [P, G] of the step's trajectories (grouped by prompt) from their rewards [P, G] and the
    shaping terms added to them (each [P, G]), and their metrics; `batch` gives each sequence's trained
    tokens for the token-weighted whitening."""
    baseline = BASELINES[grpo.baseline]
    num_tokens_PG = batch.loss_mask.sum(dim=1).view_as(rewards_PG) if grpo.whiten_over == "tokens" else None
    valid_PG = valid_samples(trajectories, rewards_PG)
    if grpo.decoupled_normalization:
        names, weights = reward_components(trajectories, extra_rewards)
        parts = [torch.tensor([t.components[name] for t in trajectories]).view_as(rewards_PG) for name in names] or [
            rewards_PG
        ]
        parts += shaping_PG  # each shaping term a component of weight 1
        weights_K = torch.tensor(weights + [1.0] * len(shaping_PG))
        advantages_PG = decoupled_advantages(
            torch.stack(parts), weights_K, baseline, num_tokens_PG=num_tokens_PG, valid_PG=valid_PG
        )
        return advantages_PG, {"train/num_reward_components": float(len(parts))}
    advantages_PG = group_advantages(
        rewards_PG + sum(shaping_PG, torch.zeros_like(rewards_PG)), baseline, grpo.normalize_std, valid_PG=valid_PG
    )
    if grpo.whiten_advantages:
        advantages_PG = batch_whiten(advantages_PG, num_tokens_PG=num_tokens_PG, valid_PG=valid_PG)
        advantages_PG = advantages_PG if valid_PG is None else advantages_PG * valid_PG
    return advantages_PG, {}


def valid_samples(trajectories: list[Trajectory], rewards_PG: torch.Tensor) -> torch.Tensor | None:
    """[P, G] bool: False on the samples excluded for an infrastructure failure (or in a dropped group,
    rollout/infra.py), which count in no group statistic; None when none is (every sample counts)."""
    if not any(t.excluded for t in trajectories):
        return None
    return torch.tensor([not t.excluded for t in trajectories]).view_as(rewards_PG)
