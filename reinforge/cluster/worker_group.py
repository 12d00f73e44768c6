"""Worker groups: N copies of a plain worker class as Ray actors on a placement group.

Resources come from config, never from decorators. Every call fans out to all workers and fails
fast: the first worker that dies (killed, out of memory, an exception) ends the call with a
`WorkerFailed` that names it and shows the last lines of its log, while the others, which may be
blocked in a collective with the dead one, are killed, never waited for.
"""

from __future__ import annotations

import glob
import os
import socket
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from reinforge.config.schema import ClusterConfig
from reinforge.errors import ReinforgeError

RAY_LOGS = Path("/tmp/ray/session_latest/logs")  # Ray's default session log directory


class WorkerFailed(ReinforgeError):
    """A worker process died or raised; the message names it and shows its last log lines."""


def start_ray(config: ClusterConfig) -> None:
    """Start a local Ray (cluster.address empty) or join an existing cluster (`auto` or HOST:PORT)."""
    if ray.is_initialized():
        return
    if config.address:
        ray.init(address=config.address, log_to_driver=False)
    else:
        ray.init(num_cpus=config.num_cpus or None, include_dashboard=False, log_to_driver=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class WorkerGroup:
    """`num_workers` actors of `worker_cls`, one per bundle of a placement group, spread over nodes."""

    def __init__(
        self,
        name: str,
        worker_cls: type,
        num_workers: int,
        args_for_rank: Callable[[int, str], tuple],
        num_cpus_per_worker: float,
        num_gpus_per_worker: float,
        timeout_s: float,
    ):
        self.name, self.timeout_s = name, timeout_s
        bundle = {"CPU": num_cpus_per_worker, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {})}
        self.placement_group: PlacementGroup = placement_group([bundle] * num_workers, strategy="SPREAD")
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement_group)
            raise ReinforgeError(
                f"{name}: the cluster cannot place {num_workers} workers of {bundle} within {timeout_s:.0f} s; "
                "lower the worker count or the per-worker resources (cluster.*), or add nodes"
            ) from None
        rank0_ip = self._bundle_ip(0)
        actor_cls = ray.remote(worker_cls)
        self.workers = [
            actor_cls.options(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank),
            ).remote(*args_for_rank(rank, rank0_ip))
            for rank in range(num_workers)
        ]
        self.names = [f"{name}[{rank}]" for rank in range(num_workers)]
        self.pids = self.call("pid")

    def _bundle_ip(self, index: int) -> str:
        node_id = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"][index]
        return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run `method(*args)` on every worker; results in rank order. Large arguments go through
        the object store once."""
        args = tuple(ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a for a in args)
        refs = [getattr(worker, method).remote(*args) for worker in self.workers]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not done:
                self.shutdown()
                raise WorkerFailed(f"{self.name}.{method} made no progress for {self.timeout_s:.0f} s (cluster.worker_timeout_s); workers stopped")
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                rank = refs.index(done[0])
                self.shutdown()
                raise WorkerFailed(f"{self.names[rank]} failed in {method}: {_first_line(exc)}{self._log_tail(rank)}") from None
        return ray.get(refs)

    def _log_tail(self, rank: int, num_lines: int = 10) -> str:
        if not getattr(self, "pids", None):
            return ""
        files = sorted(glob.glob(str(RAY_LOGS / f"worker-*-{self.pids[rank]}.*")))
        lines = [line for path in files for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
        return (" | last log lines: " + " / ".join(lines[-num_lines:])) if lines else ""

    def shutdown(self) -> None:
        """Kill every worker and free the placement group; safe to call twice."""
        for worker in getattr(self, "workers", []):
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, ray.exceptions.RayActorError):
        return "the worker process died (killed, out of memory or crashed)"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
