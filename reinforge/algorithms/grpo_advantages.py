"""The advantages of one step's scored groups, as the GRPO loop trains on them: the rewards plus their shaping
terms (DAPO's overlong penalty, the KL penalty with `loss.kl_in_reward`), normalised per group, summed
first (GRPO) or per component (GDPO, `grpo.decoupled_normalization`), then optionally whitened over the
batch (REINFORCE++), by tokens or by sequences (`grpo.whiten_over`). The tensor math is advantages.py's.
"""

from __future__ import annotations

import torch

from reinforge.algorithms.advantages import (
    BASELINES,
    batch_whiten,
    decoupled_advantages,
    group_advantages,
    overlong_penalty,
)
from reinforge.algorithms.losses import KL_ESTIMATORS
from reinforge.config import Config
from reinforge.data.batch import TrainBatch, Trajectory


def overlong_penalties(trajectories: list[Trajectory], config: Config) -> torch.Tensor:
    """DAPO's soft overlong punishment of each single-turn trajectory [N] on its number of generated tokens
    (zeros when `grpo.overlong_buffer_tokens` is 0)."""
    if not config.grpo.overlong_buffer_tokens:
        return torch.zeros(len(trajectories))
    lengths = torch.tensor([len(t.response_ids) for t in trajectories])
    return overlong_penalty(lengths, config.generation.max_new_tokens, config.grpo.overlong_buffer_tokens)


def kl_reward_penalties(batch: TrainBatch, config: Config) -> torch.Tensor:
    """With `loss.kl_in_reward`, each sequence's penalty [B] = kl_coef x the sum over its trained tokens of the
    KL estimate of the old policy against the reference (not differentiated: a reward); else zeros."""
    loss = config.loss
    if not loss.kl_in_reward:
        return torch.zeros(len(batch))
    kl_BT = KL_ESTIMATORS[loss.kl_estimator](batch.old_logprobs, batch.ref_logprobs)
    return loss.kl_coef * (kl_BT * batch.loss_mask).sum(dim=1)


def reward_components(trajectories: list[Trajectory], config: Config) -> tuple[list[str], list[float]]:
    """The named parts of the reward that GDPO normalises one by one, with their weights: the task reward and
    each `env.extra_rewards` environment (reward = task_reward + sum of weight x extra), or else the
    components every trajectory has when they sum to its reward (an agent's `reward_components`), or else
    the reward alone."""
    extras = config.env.extra_rewards
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
    config: Config,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages [P, G] of the step's trajectories (grouped by prompt) from their rewards [P, G] and the
    shaping terms added to them (each [P, G]), and their metrics; `batch` gives each sequence's trained
    tokens for the token-weighted whitening."""
    g = config.grpo
    baseline = BASELINES[g.baseline]
    num_tokens_PG = batch.loss_mask.sum(dim=1).view_as(rewards_PG) if g.whiten_over == "tokens" else None
    if g.decoupled_normalization:
        names, weights = reward_components(trajectories, config)
        parts = [torch.tensor([t.components[name] for t in trajectories]).view_as(rewards_PG) for name in names] or [
            rewards_PG
        ]
        parts += shaping_PG  # each shaping term a component of weight 1
        weights_K = torch.tensor(weights + [1.0] * len(shaping_PG))
        advantages_PG = decoupled_advantages(torch.stack(parts), weights_K, baseline, num_tokens_PG=num_tokens_PG)
        return advantages_PG, {"train/num_reward_components": float(len(parts))}
    advantages_PG = group_advantages(
        rewards_PG + sum(shaping_PG, torch.zeros_like(rewards_PG)), baseline, g.normalize_std
    )
    if g.whiten_advantages:
        advantages_PG = batch_whiten(advantages_PG, num_tokens_PG=num_tokens_PG)
    return advantages_PG, {}
