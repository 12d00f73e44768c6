"""Verifier workers: K `EnvWorker`s as Ray actors, behind the ordinary environment interface.

Each worker holds every environment of the run. A batch for one task is cut into K contiguous
slices, scored in parallel and put back in order, so the RL loop sees `dict[task, Environment]`
whether scoring runs in the driver or on K workers anywhere in the cluster. A worker that dies ends
the run through the worker group's fail-fast call (its name and last log lines in the error).
"""

from __future__ import annotations

from reinforge.cluster.config import HEARTBEAT_TIMEOUT_S
from reinforge.cluster.worker_group import WorkerGroup
from reinforge.envs.base import Environment, EnvRequest, EnvResponse
from reinforge.envs.registry import EnvConfig, EnvWorker


class EnvGroup:
    def __init__(self, env: EnvConfig, tasks: set[str], timeout_s: float, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S):
        self.group = WorkerGroup(
            "env",
            EnvWorker,
            env.num_workers,
            lambda rank, _: dict(config=env, tasks=tasks),
            num_cpus_per_worker=env.num_cpus_per_worker,
            num_gpus_per_worker=0.0,
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        self.tasks = sorted(tasks)

    def environments(self) -> dict[str, Environment]:
        return {task: _TaskOnWorkers(self, task) for task in self.tasks}

    def step(self, task: str, requests: list[EnvRequest]) -> list[EnvResponse]:
        num_workers = len(self.group.workers)
        size = -(-len(requests) // num_workers)
        slices = [requests[start : start + size] for start in range(0, len(requests), size)]
        calls = [(task, part) for part in slices]  # a short batch leaves the last workers idle
        return [response for part in self.group.call_each("step", calls) for response in part]

    def metrics(self, task: str) -> dict[str, float]:
        """Counters are summed over workers; rates and means (`*_rate`, `*_mean`, `*_fraction`, names
        with a `/`-prefix of those) are averaged over the workers that report them."""
        per_worker = [metrics[task] for metrics in self.group.call("metrics")]
        merged: dict[str, list[float]] = {}
        for metrics in per_worker:
            for name, value in metrics.items():
                merged.setdefault(name, []).append(value)
        return {
            name: (sum(values) / len(values) if _is_average(name) else sum(values)) for name, values in merged.items()
        }

    def shutdown(self) -> None:
        self.group.shutdown()


def _is_average(name: str) -> bool:
    return any(part in name for part in ("_rate", "_mean", "_fraction", "mean_", "rate/"))


class _TaskOnWorkers:
    """One task's environment as seen by the loop: an ordinary `Environment`."""

    def __init__(self, group: EnvGroup, task: str):
        self.group, self.task = group, task

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        return self.group.step(self.task, requests)

    def metrics(self) -> dict[str, float]:
        return self.group.metrics(self.task)

    def close(self) -> None:
        """The group shuts its workers down once, for all tasks."""
