"""Worker heartbeats: a stopped or wedged Ray worker is noticed within `cluster.heartbeat_timeout_s`, however long a
legitimate call to it may take (`cluster.worker_timeout_s`).

Each worker runs a daemon thread, started with the call that asks its pid, that puts a counter into Ray's key-value
store (in the GCS) every `interval_s`: no call of the driver's, no per-call cost, one small write per worker and
interval wherever the workers run. A worker whose process is stopped (SIGSTOP, a debugger), or wedged in C code that
holds the GIL, beats no more. The driver reads the counters of the workers it waits for, all in one request, only while
a call to them takes longer than an interval; a counter that has not moved for the timeout names its worker, with the
state of its process (`process_state`: read on its own node, from /proc), before the stacks are taken and the workers
are killed (cluster/worker_group.py). A worker stuck in one thread (a read of a dead filesystem) while its others run
keeps beating: that is a long call, bounded by `cluster.worker_timeout_s`.
"""

from __future__ import annotations

import glob
import os
import threading
import time
import uuid
from pathlib import Path

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "reinforge-heartbeat"
STATE_TIMEOUT_S = 10.0  # reading a process's state on another node
STATES = {
    "R": "running (R)",
    "S": "sleeping (S)",
    "D": "uninterruptible (D)",
    "T": "stopped (T)",
    "t": "stopped by a tracer (t)",
    "Z": "a zombie (Z)",
    "X": "dead (X)",
}


def interval_for(timeout_s: float) -> float:
    """How often a worker beats and a waiting driver looks: six looks per timeout, at most every 10 s."""
    return max(min(timeout_s / 6, 10.0), 0.2)


def start_beating(_actor, key: str, interval_s: float) -> int:
    """In a worker (`__ray_call__`): start its heartbeat thread; its pid."""

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                internal_kv._internal_kv_put(key, str(count), namespace=NAMESPACE)
            except Exception:  # noqa: BLE001  the GCS unreachable: the driver sees the missing beats
                pass
            time.sleep(interval_s)

    threading.Thread(target=beat, name="reinforge-heartbeat", daemon=True).start()
    return os.getpid()


class Heartbeats:
    """The heartbeats of one worker group's workers, as the driver reads them."""

    def __init__(self, num_workers: int, timeout_s: float):
        self.timeout_s, self.interval_s = timeout_s, interval_for(timeout_s)
        self.prefix = f"{uuid.uuid4().hex}/"
        self.keys = [f"{self.prefix}{rank}" for rank in range(num_workers)]

    def watch(self) -> Watch:
        """What one wait has seen: a counter counts as moving from the wait's first look on."""
        return Watch(self)

    def forget(self) -> None:
        """Remove the group's counters from the store (its workers are gone)."""
        if ray.is_initialized():
            try:
                internal_kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=NAMESPACE)
            except Exception:  # noqa: BLE001  a store that is gone holds nothing
                pass


class Watch:
    def __init__(self, heartbeats: Heartbeats):
        self.heartbeats = heartbeats
        self.seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (its counter, when it last moved)

    def silent(self, ranks: list[int]) -> list[int]:
        """Of `ranks`, those whose counter has not moved for the timeout (since this wait's first look)."""
        keys = [self.heartbeats.keys[rank].encode() for rank in ranks]
        try:
            values = internal_kv.internal_kv_get_gcs_client().internal_kv_multi_get(keys, namespace=NAMESPACE.encode())
        except Exception:  # noqa: BLE001  the GCS did not answer this time: no verdict (Ray's own errors will come)
            return []
        now = time.monotonic()
        for rank, key in zip(ranks, keys):
            if rank not in self.seen or self.seen[rank][0] != values.get(key):
                self.seen[rank] = (values.get(key), now)
        return [rank for rank in ranks if now - self.seen[rank][1] >= self.heartbeats.timeout_s]


def read_state(pid: int) -> str:
    """The state of process `pid` of this machine, as /proc shows it; with the threads in uninterruptible sleep."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        tasks = glob.glob(f"/proc/{pid}/task/*/stat")
        threads = [Path(path).read_text().rsplit(")", 1)[1].split()[0] for path in tasks]
    except (OSError, IndexError):
        return "gone"
    text = STATES.get(state, f"state {state}")
    stuck = threads.count("D")
    if stuck and state != "D":
        text += f", {stuck} of {len(threads)} threads uninterruptible (D)"
    return text


@ray.remote(num_cpus=0)
def _read_state_there(pid: int) -> str:
    return read_state(pid)


def process_state(pid: int, node_id: str) -> str:
    """`read_state` of a worker's process, on its own node (`node_id`), here when that is this process's."""
    if node_id == ray.get_runtime_context().get_node_id():
        return read_state(pid)
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    try:
        return ray.get(_read_state_there.options(scheduling_strategy=strategy).remote(pid), timeout=STATE_TIMEOUT_S)
    except Exception:  # noqa: BLE001  the node is gone or does not answer: say so
        return f"state unknown: its node did not answer within {STATE_TIMEOUT_S:g} s"
