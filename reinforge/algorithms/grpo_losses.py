"""GRPO's own math: the advantages of one step's scored groups, as its step (grpo.py) trains on them (its loss is
the shared clipped policy loss, policy_loss.py). The rewards plus their shaping terms (DAPO's overlong penalty,
`overlong.*`, shaping.py; the KL penalty with `loss.kl_in_reward`), normalised per group, summed first (GRPO) or per
component (GDPO, `grpo.decoupled_normalization`), then optionally whitened over the batch (REINFORCE++), by tokens
or by sequences (`grpo.whiten_over`). The tensor math is advantages.py's.
"""

from __future__ import annotations

import torch

from reinforge.algorithms.advantages import BASELINES, batch_whiten, decoupled_advantages, group_advantages
from reinforge.algorithms.grpo_config import GRPOConfig
from reinforge.algorithms.losses import KL_ESTIMATORS
from reinforge.algorithms.policy_loss import PolicyLossConfig, kl_in_reward
from reinforge.algorithms.shaping import valid_samples
from reinforge.data.batch import TrainBatch, Trajectory


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
