"""Worker groups: N copies of a plain worker class as Ray actors on a placement group.

Resources come from config, never from decorators. A worker is built in two calls: the actor starts
empty, then `setup` runs the worker class's `__init__` as a method, so an error it raises (a setting only
the worker can check) comes back as that exception, as any method's does. Every call fans out to all
workers and fails fast: the first worker that dies (killed, out of memory, an exception) ends the call with a
`WorkerFailed` that names it and shows the last lines of its log, while the others, which may be
blocked in a collective with the dead one, are killed, never waited for. A call in which no worker finishes for
`cluster.worker_timeout_s` ends with a `WorkerHang` that holds every worker's stack, taken before they are killed
(reinforge/hang.py).
"""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from reinforge.cluster.config import TrainerClusterConfig
from reinforge.errors import InfrastructureError, ReinforgeError
from reinforge.hang import HangError, register_workers, unregister_workers

RAY_LOGS = Path("/tmp/ray/session_latest/logs")  # Ray's default session log directory
PLACEMENT_TIMEOUT_S = 60.0  # resources that are not there within a minute will not appear


class WorkerFailed(InfrastructureError):
    """A worker process died or stopped answering; the message names it and shows its last log lines. A
    supervised run restarts from its last checkpoint after it (cluster.max_restarts)."""


class WorkerHang(WorkerFailed, HangError):
    """A worker call in which no worker finished within `cluster.worker_timeout_s`."""


def start_ray(config: TrainerClusterConfig, num_cpus_needed: float) -> None:
    """Start a local Ray (cluster.address empty) or join an existing cluster (`auto` or HOST:PORT).

    A local Ray gets `cluster.num_cpus` logical CPUs, or by default enough for the run's workers even
    if that is more than the machine's cores: on CPU, workers that oversubscribe the cores only run
    slower, while too few logical CPUs would leave workers unplaced."""
    if ray.is_initialized():
        return
    if config.address:
        ray.init(address=config.address, log_to_driver=False)
    else:
        num_cpus = config.num_cpus or max(os.cpu_count() or 1, math.ceil(num_cpus_needed))
        # address="local": a new Ray of our own, never a cluster some other job left running on this machine
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def ensure_ray(config: TrainerClusterConfig, num_cpus_needed: float) -> Callable[[], None]:
    """`start_ray` unless Ray already runs in this process. Returns the cleanup: `ray.shutdown` for a Ray
    that this call started or joined, a no-op for one that was running before (whoever started it stops it)."""
    if ray.is_initialized():
        return lambda: None
    start_ray(config, num_cpus_needed)
    return ray.shutdown


class WorkerGroup:
    """`num_workers` actors of `worker_cls`, one per bundle of a placement group, spread over nodes."""

    def __init__(
        self,
        name: str,
        worker_cls: type,
        num_workers: int,
        kwargs_for_rank: Callable[[int, str], dict[str, Any]],
        num_cpus_per_worker: float,
        num_gpus_per_worker: float,
        timeout_s: float,
        share_with: "WorkerGroup | None" = None,
        actor_fraction: float = 1.0,
        max_concurrency: int = 1,
        resources: dict[str, float] | None = None,
        bundle_stride: int = 1,
        env_for_rank: Callable[[int], dict[str, str]] | None = None,
    ):
        """With `share_with`, the workers go into that group's bundles (worker i into bundle i x `bundle_stride`)
        instead of bundles of their own: colocation. `actor_fraction` of a bundle is what each actor asks for,
        leaving the rest to the group that will share it. `max_concurrency` > 1: each worker runs up to that
        many calls at once, each on a thread of its own (Ray's threaded actors), for a worker that is thread-safe.
        `resources`: custom Ray resources each worker's bundle requires (cluster.training_resources, ...), which
        place the group on the nodes that offer them; `env_for_rank(i)`: environment variables set in worker i's
        process before its `setup`. GPU bundles are packed node by node (PACK), so that neighbouring ranks
        (a tensor-parallel group, a colocated engine's) share a node; CPU bundles are spread over the nodes."""
        self.name, self.timeout_s = name, timeout_s
        bundle = {"CPU": num_cpus_per_worker, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {})}
        bundle |= resources or {}
        self.owns_placement_group = share_with is None
        self.bundle_indices = [rank * bundle_stride for rank in range(num_workers)]
        if share_with is None:
            strategy = "PACK" if num_gpus_per_worker else "SPREAD"
            self.placement_group = placement_group([bundle] * num_workers, strategy=strategy)
            try:
                ray.get(self.placement_group.ready(), timeout=min(timeout_s, PLACEMENT_TIMEOUT_S))
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(self.placement_group)
                raise ReinforgeError(
                    f"{name}: the cluster cannot place {num_workers} workers of {bundle} within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; lower the worker count or the per-worker resources (cluster.*), "
                    "or add nodes"
                ) from None
        else:
            self.placement_group = share_with.placement_group
        rank0_ip = self._bundle_ip(0)
        actor_cls = ray.remote(set_up_later(worker_cls))
        self.workers = [
            actor_cls.options(
                num_cpus=num_cpus_per_worker * actor_fraction,
                num_gpus=num_gpus_per_worker * actor_fraction,
                max_concurrency=max_concurrency,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in self.bundle_indices
        ]
        self.names = [f"{name}[{rank}]" for rank in range(num_workers)]
        try:
            self.pids = ray.get([worker.__ray_call__.remote(lambda _: os.getpid()) for worker in self.workers])
        except ray.exceptions.RayActorError as exc:  # its process died starting
            self.shutdown()
            raise WorkerFailed(f"{name}: a worker failed to start: {_first_line(exc)}") from None
        register_workers(dict(zip(self.names, self.pids)))
        if env_for_rank is not None:
            self.call_each("__ray_call__", [(_set_environment, env_for_rank(rank)) for rank in range(num_workers)])
        self.call_each(
            "setup", [(kwargs_for_rank(rank, rank0_ip),) for rank in range(num_workers)]
        )  # all ranks at once

    def node_ids(self) -> list[str]:
        """The Ray node of each worker's bundle, in rank order."""
        table = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"]
        return [table[index] for index in self.bundle_indices[: len(self.workers)]]

    def gpu_ids(self) -> list[list[str]]:
        """The GPUs Ray gave each worker (its CUDA_VISIBLE_DEVICES), in rank order."""
        return self.call_each("__ray_call__", [(_gpu_ids,)] * len(self.workers))

    def _bundle_ip(self, index: int) -> str:
        node_id = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"][index]
        return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run `method(*args)` on every worker; results in rank order. Large arguments go through
        the object store once."""
        args = tuple(ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a for a in args)
        return self.call_each(method, [args] * len(self.workers))

    def call_each(self, method: str, args_per_worker: list[tuple]) -> list[Any]:
        """Run `method(*args_per_worker[i])` on worker i, all at once; results in rank order."""
        refs = [getattr(worker, method).remote(*args) for worker, args in zip(self.workers, args_per_worker)]
        return self._wait(method, refs, self.names)

    def call_rank(self, rank: int, method: str, *args: Any) -> Any:
        """Run `method(*args)` on worker `rank` alone (thread-safe: concurrent calls wait each for its own)."""
        return self._wait(method, [getattr(self.workers[rank], method).remote(*args)], [self.names[rank]])[0]

    def _wait(self, method: str, refs: list, names_in_order: list[str]) -> list[Any]:
        names = dict(zip(refs, names_in_order))
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not done:
                waiting = [names[ref] for ref in pending]
                what = f"{', '.join(waiting)} to finish {method}"
                error = WorkerHang(self.name, what, self.timeout_s, "cluster.worker_timeout_s")
                error.capture(dict(zip(self.names, self.pids)))  # before they are killed
                self.shutdown()
                raise error
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                rank = self.names.index(names[done[0]])
                self.shutdown()
                if (error := raised_in_worker(exc)) is not None:
                    raise error from None
                raise WorkerFailed(
                    f"{self.names[rank]} failed in {method}: {_first_line(exc)}{self._log_tail(rank)}"
                ) from None
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
        unregister_workers(getattr(self, "names", []))
        if self.placement_group is not None and self.owns_placement_group:
            remove_placement_group(self.placement_group)
        self.placement_group = None


def _set_environment(_, env: dict[str, str]) -> None:
    os.environ.update(env)


def _gpu_ids(_) -> list[str]:
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def set_up_later(worker_cls: type) -> type:
    """`worker_cls` whose construction does nothing and whose `setup(kwargs)` runs its `__init__(**kwargs)`:
    Ray returns an exception raised in a method as its `cause`, one raised in `__init__` only as text."""

    class Worker(worker_cls):
        def __init__(self):  # noqa: D107  the real construction is `setup`
            pass

        def setup(self, kwargs: dict[str, Any]) -> None:
            worker_cls.__init__(self, **kwargs)

    Worker.__name__ = Worker.__qualname__ = worker_cls.__name__  # Ray names the actor after it
    return Worker


def raised_in_worker(exc: BaseException) -> ReinforgeError | None:
    """A user-facing error that a worker raised (a setting only the worker can check, such as one that
    needs a GPU), as itself, so that the command line prints its one line: Ray carries it as `cause`."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, ReinforgeError) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed:
        return "the worker process died (killed, out of memory or crashed)"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
