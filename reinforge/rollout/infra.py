"""Infrastructure failures are not the policy's (docs/environments.md has the table of who fails).

An episode whose environment server, Gym server, sandbox or HTTP connection failed, or that timed out
waiting on one, carries `Trajectory.infra_failure` (its kind) instead of a reward. `settle` then:

1. re-runs the failed episodes from their prompt, with fresh sessions, up to `max_retries` times;
2. masks the ones still failing: `excluded`, never trained on and in no statistic (not the group's
   baseline, not its standard deviation, not the reward means);
3. drops each group left with fewer than `min_valid_per_group` valid samples (all of its samples
   excluded; the rows stay in the batch, so every learner still sees groups of G);
4. stops the run with one line naming the failure and the component when more than
   `max_failure_fraction` of the step's episodes are masked, or when no group is left.

Every failed attempt is counted by kind in `rollout/infra_<kind>`; `rollout/infra_retried` counts the
re-runs, `rollout/infra_masked` the episodes masked, `rollout/infra_groups_dropped` the groups dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from reinforge.data.batch import Trajectory
from reinforge.errors import InfrastructureError

Rerun = Callable[[list[int], int], list[Trajectory]]  # (indices to re-run, retry number from 0) -> fresh ones


class InfraFailureError(InfrastructureError):
    """So many episodes of a step failed on infrastructure that there is nothing trustworthy to train on. A supervised
    run restarts from its last checkpoint after it (cluster.max_restarts): the component may be back by then."""


@dataclass(frozen=True)
class InfraLimits:
    """`rollout.max_infra_retries`, `rollout.min_valid_per_group`, `rollout.max_infra_failure_fraction`."""

    max_retries: int
    min_valid_per_group: int
    max_failure_fraction: float


NO_HOLES = InfraLimits(max_retries=2, min_valid_per_group=1, max_failure_fraction=0.0)
"""For evaluations and the curriculum's pass rates, which must score every sample: retried, then the run stops."""


def settle(
    trajectories: list[Trajectory], group_size: int, rerun: Rerun, limits: InfraLimits
) -> tuple[list[Trajectory], dict[str, float]]:
    """The step's trajectories (grouped by prompt, `group_size` each) with their infrastructure failures
    retried, masked and their groups dropped as the module doc says, and the `rollout/infra_*` metrics."""
    trajectories = list(trajectories)
    counts: Counter[str] = Counter()
    first_error: dict[str, str] = {}

    def failures(indices: list[int]) -> list[int]:
        failed = [index for index in indices if trajectories[index].infra_failure]
        for index in failed:
            kind = trajectories[index].infra_failure
            counts[kind] += 1
            first_error.setdefault(kind, trajectories[index].infra_error or kind)
        return failed

    failed = failures(list(range(len(trajectories))))
    num_retried = 0
    for retry in range(limits.max_retries):
        if not failed:
            break
        num_retried += len(failed)
        for index, fresh in zip(failed, rerun(failed, retry), strict=True):
            fresh.group = trajectories[index].group
            trajectories[index] = fresh
        failed = failures(failed)
    for index in failed:
        trajectories[index].masked = trajectories[index].excluded = True
    num_groups_dropped = 0
    need = min(limits.min_valid_per_group, group_size)
    for start in range(0, len(trajectories), group_size):
        group = trajectories[start : start + group_size]
        if sum(not t.excluded for t in group) < need:
            num_groups_dropped += 1
            for trajectory in group:
                trajectory.masked = trajectory.excluded = True
    metrics = {f"rollout/infra_{kind}": float(count) for kind, count in sorted(counts.items())}
    metrics.update(
        {
            "rollout/infra_retried": float(num_retried),
            "rollout/infra_masked": float(len(failed)),
            "rollout/infra_groups_dropped": float(num_groups_dropped),
        }
    )
    fraction = len(failed) / len(trajectories) if trajectories else 0.0
    if failed and (fraction > limits.max_failure_fraction or all(t.excluded for t in trajectories)):
        kind = trajectories[failed[0]].infra_failure
        raise InfraFailureError(
            f"{len(failed)} of {len(trajectories)} episodes still failed on infrastructure after "
            f"{limits.max_retries} retries ({kind}; rollout.max_infra_failure_fraction="
            f"{limits.max_failure_fraction:g}, rollout.min_valid_per_group={limits.min_valid_per_group}): "
            f"{trajectories[failed[0]].infra_error or first_error[kind]}"
        )
    return trajectories, metrics
