"""Worker groups: N copies of a plain worker class as Ray actors on a placement group.

Resources come from config, never from decorators. A worker is built in two calls: the actor starts
empty, then `setup` runs the worker class's `__init__` as a method, so an error it raises (a setting only
the worker can check) comes back as that exception, as any method's does. Every call fans out to all
workers and fails fast: the first worker that fails ends the call, while the others, which may be blocked in a
collective with it, are killed, never waited for. How it ends depends on whose the failure is:
- a worker that died (killed, out of memory, crashed), or raised what a restart can fix (`errors.is_transient`: a
  connection reset, a timeout; a collective whose peer failed): `WorkerFailed`, with its last log lines, restarted;
- a worker that raised anything else (a KeyError, a CUDA out-of-memory error that the same step would meet again):
  `WorkerError`, one line naming the worker, the method and the exception, its traceback in the run's log; never
  restarted, since the same step would raise it again;
- a call unfinished after `cluster.worker_timeout_s` in all, or a worker whose heartbeat stopped for
  `cluster.heartbeat_timeout_s` (stopped, wedged: cluster/heartbeat.py, the message gives its process state):
  `WorkerHang`, with every worker's stack, taken before they are killed (reinforge/hang.py), restarted.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from reinforge.cluster.config import HEARTBEAT_TIMEOUT_S, TrainerClusterConfig
from reinforge.cluster.heartbeat import Heartbeats, process_state, start_beating
from reinforge.errors import InfrastructureError, ReinforgeError, is_transient
from reinforge.hang import HangError, register_workers, unregister_workers

RAY_LOGS = Path("/tmp/ray/session_latest/logs")  # Ray's default session log directory
PLACEMENT_TIMEOUT_S = 60.0  # resources that are not there within a minute will not appear
PEER_GRACE_S = 5.0  # after a worker's exception, how long its peers have to show whether one of them died first
# dependencies' exceptions that a failure outside the worker's own code causes: a collective whose peer failed
# (torch.distributed's; gloo's are RuntimeErrors that name gloo), vLLM's engine core process that died
INFRASTRUCTURE_EXCEPTIONS = {"torch": "DistError", "vllm": "EngineDeadError"}
_log = logging.getLogger(__name__)


class WorkerFailed(InfrastructureError):
    """A worker process died or stopped answering; the message names it and shows its last log lines. A
    supervised run restarts from its last checkpoint after it (cluster.max_restarts)."""


class WorkerHang(WorkerFailed, HangError):
    """A worker call unfinished within `cluster.worker_timeout_s`, or a worker without a heartbeat for
    `cluster.heartbeat_timeout_s`."""


class WorkerError(ReinforgeError):
    """A worker raised an exception that a restart would meet again (a bug, or a resource the step needs): the run
    ends with its one line (exit status 2), not restarted."""


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
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
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
        process before its `setup`. `timeout_s`: the longest a call may take; `heartbeat_timeout_s`: the longest a
        worker may go without a heartbeat (cluster/heartbeat.py). GPU bundles are packed node by node (PACK), so that
        neighbouring ranks (a tensor-parallel group, a colocated engine's) share a node; CPU bundles are spread over
        the nodes."""
        self.name, self.timeout_s = name, timeout_s
        self.heartbeats = Heartbeats(num_workers, heartbeat_timeout_s)
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
        interval = self.heartbeats.interval_s
        starts = [w.__ray_call__.remote(start_beating, k, interval) for w, k in zip(self.workers, self.heartbeats.keys)]
        try:
            self.pids = ray.get(starts, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:  # a node that never starts the process (no pids to dump yet)
            error = WorkerHang(name, "its workers' processes to start", timeout_s, "cluster.worker_timeout_s")
            error.capture()
            self.shutdown()
            raise error from None
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
        """The calls' results, under one deadline for them all (`timeout_s`), each pending worker's heartbeat looked
        at every heartbeat interval; the first failure ends the call (the module's docstring)."""
        names = dict(zip(refs, names_in_order))
        deadline, watch, pending = time.monotonic() + self.timeout_s, self.heartbeats.watch(), list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                what = f"{', '.join(names[ref] for ref in pending)} to finish {method}"
                raise self._hang(WorkerHang(self.name, what, self.timeout_s, "cluster.worker_timeout_s"))
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, self.heartbeats.interval_s))
            if done:
                try:
                    ray.get(done[0])
                except ray.exceptions.RayError as exc:
                    rank = self.names.index(names[done[0]])
                    if worker_bug(exc) is not None and (death := dead_peer(pending)) is not None:
                        rank, exc = self.names.index(names[death[0]]), death[1]  # the cause of the exception
                    error = self._failure(method, rank, exc)
                    self.shutdown()
                    raise error from None
            elif silent := watch.silent([self.names.index(names[ref]) for ref in pending]):
                raise self._hang(self._silent(method, silent[0]))
        return ray.get(refs)

    def _hang(self, error: WorkerHang) -> WorkerHang:
        error.capture()  # every worker's stack (all groups'), before they are killed
        self.shutdown()
        return error

    def _silent(self, method: str, rank: int) -> WorkerHang:
        state = process_state(self.pids[rank], self.node_ids()[rank])
        what = f"a heartbeat from {self.names[rank]} (pid {self.pids[rank]}: {state}) in {method}"
        return WorkerHang(self.name, what, self.heartbeats.timeout_s, "cluster.heartbeat_timeout_s")

    def _failure(self, method: str, rank: int, exc: BaseException) -> ReinforgeError:
        """What worker `rank`'s failure in `method` ends the run with: the error it raised when that is a
        `ReinforgeError`, a `WorkerError` for an exception a restart would meet again, else `WorkerFailed`."""
        if (error := raised_in_worker(exc)) is not None:
            return error
        if (cause := worker_bug(exc)) is not None:
            _log.error("%s raised %s in %s:\n%s", self.names[rank], type(cause).__name__, method, exc)
            message = (str(cause).strip().splitlines() or ["(no message)"])[0]
            return WorkerError(
                f"{self.names[rank]} raised {type(cause).__name__} in {method}: {message} "
                f"(not restarted: the same step would raise it again; the worker's traceback is in {_log_file()})"
            )
        return WorkerFailed(f"{self.names[rank]} failed in {method}: {_first_line(exc)}{self._log_tail(rank)}")

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
        self.heartbeats.forget()
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


def worker_bug(exc: BaseException) -> BaseException | None:
    """The exception a worker's method raised, when it is neither a `ReinforgeError` nor one a restart can fix."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else None
    if cause is None or isinstance(cause, ReinforgeError) or infrastructure(cause):
        return None
    return cause


def infrastructure(exc: BaseException) -> bool:
    """Whether an exception a worker raised is one a restart can fix: `errors.is_transient`, Ray's own (a call to
    another actor that died), or one of INFRASTRUCTURE_EXCEPTIONS."""
    if is_transient(exc) or isinstance(exc, ray.exceptions.RayError):
        return True
    for cls in type(exc).__mro__:
        if INFRASTRUCTURE_EXCEPTIONS.get(cls.__module__.split(".")[0]) == cls.__name__:
            return True
    return any(word in str(exc) for word in ("gloo/", "NCCL", "c10d"))


def dead_peer(pending: list) -> tuple[Any, ray.exceptions.RayActorError] | None:
    """The first of the call's other workers (`pending`) to die within PEER_GRACE_S, with its error, or None: after a
    worker's exception, which may be a collective's with a peer that died a moment before Ray noticed."""
    if not pending:
        return None
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return ref, exc
        except ray.exceptions.RayError:
            pass
    return None


def _log_file() -> str:
    """The file the root logger writes to (RUN_DIR/logs/dependencies.log in a run), or stderr."""
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return files[0] if files else "stderr"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed:
        return "the worker process died (killed, out of memory or crashed)"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
