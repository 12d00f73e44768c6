"""The metrics of one step of the RL loop's recipes (GRPO, PPO, distillation): the rollout,
the advantages, the optimizer steps and the environments. Each formula is in docs/metrics.md."""

from __future__ import annotations

import torch

from reinforge.algorithms.shaping import OverlongConfig
from reinforge.data.batch import TrainBatch, Trajectory
from reinforge.envs.base import Environment
from reinforge.rollout.source import RolloutBatch


def step_rewards(step: int, rollout_batch: RolloutBatch, group_size: int) -> tuple[torch.Tensor | None, dict]:
    """A step's rewards [P, G] (None: the batch is empty, nothing to learn from) and its rollout and staleness
    metrics, the start of every RL recipe's step."""
    metrics = {**rollout_batch.metrics, **staleness_metrics(step, rollout_batch)}
    if not rollout_batch.trajectories:
        return None, metrics
    return torch.tensor([t.reward for t in rollout_batch.trajectories]).view(-1, group_size), metrics


def staleness_metrics(step: int, batch: RolloutBatch) -> dict[str, float]:
    """How far behind the trainer the policy that generated this step's batch was (0: on-policy)."""
    return {"rollout/policy_version": batch.policy_version, "rollout/policy_lag": step - 1 - batch.policy_version}


def per_task_means(trajectories: list[Trajectory], prefix: str, name: str) -> dict[str, float]:
    """`{prefix}/{task}/{name}` (mean reward) and the mean of each reward component, per task."""
    by_task: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        by_task.setdefault(trajectory.task, []).append(trajectory)
    metrics = {}
    for task, group in by_task.items():
        metrics[f"{prefix}/{task}/{name}"] = sum(t.reward for t in group) / len(group)
        for component in sorted({c for t in group for c in t.components}):
            values = [t.components[component] for t in group if component in t.components]
            metrics[f"{prefix}/{task}/{component}_mean"] = sum(values) / len(values)
    return metrics


def rollout_metrics(trajectories: list[Trajectory], rewards_PG: torch.Tensor) -> dict[str, float]:
    """The rewards over the samples that count (not those excluded for an infrastructure failure, which have
    none, nor the groups dropped for it: rollout/infra.py); the lengths over all."""
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
    valid_PG = torch.tensor([not t.excluded for t in trajectories]).view_as(rewards_PG)
    rewards = rewards_PG[valid_PG] if valid_PG.any() else torch.zeros(1)
    kept_groups_PG = rewards_PG[valid_PG.all(dim=1)]  # a kept group may still hold a masked sample: not in this one
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std": rewards.std(unbiased=False).item(),
        "train/zero_std_group_fraction": (kept_groups_PG.std(dim=1) == 0).float().mean().item()
        if len(kept_groups_PG)
        else 0.0,
        "rollout/gen_len_mean": lengths.mean().item(),
        "rollout/gen_len_max": lengths.max().item(),
        "rollout/truncated_fraction": sum(t.truncated for t in trajectories) / len(trajectories),
        "rollout/prompt_len_mean": sum(len(t.prompt_ids) for t in trajectories) / len(trajectories),
        "rollout/turns_mean": sum(t.num_turns for t in trajectories) / len(trajectories),
        **per_task_means([t for t in trajectories if not t.excluded], "train", "reward_mean"),
    }


def token_advantage_metrics(batch: TrainBatch, kl_penalties_PG: torch.Tensor, kl_in_reward: bool) -> dict[str, float]:
    """The advantages over the trained tokens (what token-level whitening makes 0 and 1), and the KL penalty in
    the reward (`loss.kl_in_reward`)."""
    mask_BT, advantages_BT = batch.loss_mask, batch.advantages
    num_tokens = mask_BT.sum().clamp(min=1)
    mean = (advantages_BT * mask_BT).sum() / num_tokens
    metrics = {
        "train/advantage_token_mean": mean.item(),
        "train/advantage_token_std": (((advantages_BT - mean) ** 2 * mask_BT).sum() / num_tokens).sqrt().item(),
    }
    if kl_in_reward:
        metrics["train/kl_reward_penalty_mean"] = -kl_penalties_PG.mean().item()
    return metrics


def advantage_metrics(
    trajectories: list[Trajectory], penalties_PG: torch.Tensor, advantages_PG: torch.Tensor, overlong: OverlongConfig
) -> dict[str, float]:
    """The advantages trained on, and what overlong shaping and filtering did to this step's batch."""
    metrics = {
        "train/advantage_mean": advantages_PG.mean().item(),
        "train/advantage_std": advantages_PG.std(unbiased=False).item(),
        "train/zero_advantage_fraction": (advantages_PG == 0).float().mean().item(),
    }
    if overlong.buffer_tokens:
        metrics["rollout/overlong_penalty_mean"] = penalties_PG.mean().item()
    if overlong.filtering:
        metrics["rollout/overlong_filtered_fraction"] = sum(t.truncated for t in trajectories) / len(trajectories)
    return metrics


def train_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """Mean over the step's optimizer steps; extremes by max/min; a cumulative count by its last value."""
    out = {}
    for name in updates[0] if updates else []:
        values = [u[name] for u in updates]
        if name == "nonfinite_steps":
            out[f"train/{name}"] = values[-1]
        elif name.endswith("_max"):
            out[f"train/{name}"] = max(values)
        elif name.endswith("_min"):
            out[f"train/{name}"] = min(values)
        else:
            out[f"train/{name}"] = sum(values) / len(values)
    out["train/num_optimizer_steps"] = len(updates)
    return out


def env_metrics(envs: dict[str, Environment], scored: set[str]) -> dict[str, float]:
    """`env/{task}/{name}`: the counters since the last call of each environment in `scored`, those that scored
    something (the counters of one that scored nothing, all 0, would read as a verifier that never failed). Every
    environment's counters are read, and so reset."""
    counters = {task: env.metrics() for task, env in envs.items()}
    return {f"env/{task}/{name}": value for task in scored & set(counters) for name, value in counters[task].items()}


def scored_tasks(tasks: set[str], driver: str, extra_rewards: dict[str, float]) -> set[str]:
    """The environments that scored trajectories of `tasks`: those tasks' and the extra rewards' when reinforge
    drives the episodes; none when agents do (they score their own)."""
    return tasks | set(extra_rewards) if driver == "reinforge" else set()
