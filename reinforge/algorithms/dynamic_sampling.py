"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): extra rollout rounds until a step has enough
groups whose rewards are not all equal (`grpo.dynamic_sampling`)."""

from __future__ import annotations

from typing import Callable

import torch

from reinforge.algorithms.advantages import informative_groups
from reinforge.data.batch import Trajectory


def fill_with_informative_groups(
    rollout_round: Callable[[int], list[Trajectory]], num_groups: int, group_size: int, max_extra_rounds: int
) -> tuple[list[Trajectory], dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): call `rollout_round(0)`, `rollout_round(1)`,
    ... (each returns whole groups of `group_size` trajectories, grouped by prompt), drop the groups whose
    rewards are all equal, and stop once `num_groups` groups are kept (the surplus of the last round is
    discarded) or after `max_extra_rounds` extra rounds. Deviation: DAPO samples until the batch is full;
    here a step that runs out of rounds trains on the groups it has, possibly none. Each trajectory of a group left
    out says why in `discarded` (the prompts ledger lists its prompt, loops/checkpointing.py): `equal_rewards` (its
    rewards all equal: no learning signal), `infra_failures` (fewer than two of its samples scored: the others' scoring
    failed, rollout/infra.py), `surplus` (the batch was full)."""
    kept: list[list[Trajectory]] = []
    num_rounds = num_generated = num_dropped = 0
    while len(kept) < num_groups and num_rounds <= max_extra_rounds:
        trajectories = rollout_round(num_rounds)
        num_rounds += 1
        groups = [trajectories[start : start + group_size] for start in range(0, len(trajectories), group_size)]
        rewards_PG = torch.tensor([[t.reward for t in group] for group in groups])
        valid_PG = torch.tensor([[not t.excluded for t in group] for group in groups])  # infra failures: no reward
        keep = informative_groups(rewards_PG, valid_PG).tolist()
        kept += [group for group, informative in zip(groups, keep) if informative]
        num_generated += len(groups)
        num_dropped += keep.count(False)
        for group, informative in zip(groups, keep):
            if not informative:  # fewer than two samples that count: their environment failed (rollout/infra.py)
                counted = sum(not t.excluded for t in group)
                discard([group], "equal_rewards" if counted >= 2 else "infra_failures")
    discard(kept[num_groups:], "surplus")
    kept = kept[:num_groups]
    for index, group in enumerate(kept):  # `group` indexes the step's prompts, now across rounds
        for trajectory in group:
            trajectory.group = index
    metrics = {
        "rollout/dynamic_sampling_rounds": num_rounds,
        "rollout/num_dropped_groups": num_dropped,
        "rollout/dropped_group_fraction": num_dropped / num_generated,
        "rollout/num_trained_groups": len(kept),
    }
    return [trajectory for group in kept for trajectory in group], metrics


def discard(groups: list[list[Trajectory]], reason: str) -> None:
    for group in groups:
        for trajectory in group:
            trajectory.discarded = reason
