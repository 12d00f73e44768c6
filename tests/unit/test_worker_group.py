"""How a call to a Ray worker group ends (cluster/worker_group.py), with real Ray workers of a tiny class: a worker's
bug (KeyError) is one line and not restartable, after one attempt; a worker that dies, or raises what a restart can
fix, is restartable; a worker stopped with SIGSTOP is noticed by its heartbeat (cluster.heartbeat_timeout_s) while its
peer's long call is not; a call has one deadline in all, not one per worker that finishes."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from ray import cloudpickle

from reinforge.cluster import worker_group
from reinforge.cluster.config import TrainerClusterConfig
from reinforge.cluster.heartbeat import read_state
from reinforge.cluster.worker_group import WorkerError, WorkerFailed, WorkerGroup, WorkerHang
from reinforge.errors import InfrastructureError, is_transient

pytestmark = pytest.mark.xdist_group("ray")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module: Tiny by value


class Tiny:
    def __init__(self, rank: int, calls: str):
        self.rank, self.calls = rank, Path(calls)

    def fail(self, kind: str, delays: list[float]) -> None:
        with self.calls.open("a") as calls:
            calls.write(f"{self.rank}\n")
        time.sleep(delays[self.rank])
        if kind == "key":
            raise KeyError("no_such_column")
        if kind == "reset":
            raise ConnectionResetError("connection reset by the env server")
        if kind == "key then die":
            if self.rank == 0:
                raise KeyError("no_such_column")
            os._exit(1)

    def sleep(self, seconds: list[float]) -> int:
        time.sleep(seconds[self.rank])
        return self.rank


@pytest.fixture(scope="module")
def ray_up():
    stop = worker_group.ensure_ray(TrainerClusterConfig(num_cpus=2), 1)
    yield
    stop()


def group(tmp_path, num_workers=2, timeout_s=60.0, heartbeat_timeout_s=60.0) -> WorkerGroup:
    calls = str(tmp_path / "calls")
    return WorkerGroup(
        "tiny", Tiny, num_workers, lambda rank, _: dict(rank=rank, calls=calls), num_cpus_per_worker=0.1,
        num_gpus_per_worker=0.0, timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
    )  # fmt: skip


def test_a_worker_raising_key_error_ends_the_call_with_one_line_after_one_attempt(ray_up, tmp_path):
    with pytest.raises(WorkerError) as raised:
        group(tmp_path).call("fail", "key", [0.0, 0.0])
    error = raised.value
    assert not isinstance(error, InfrastructureError) and not is_transient(error)  # exit 2, never restarted
    line = str(error)
    assert "\n" not in line and " raised KeyError in fail: 'no_such_column' (not restarted" in line, line
    assert line.startswith(("tiny[0]", "tiny[1]")), line
    assert sorted((tmp_path / "calls").read_text().split()) == ["0", "1"]  # each worker called once


def test_a_worker_that_dies_or_raises_a_transient_error_is_restartable(ray_up, tmp_path):
    with pytest.raises(WorkerFailed) as raised:
        group(tmp_path).call("fail", "reset", [0.0, 0.0])
    assert "ConnectionResetError" in str(raised.value) and is_transient(raised.value)
    # rank 0's KeyError comes first, but its peer dies a moment later: the peer's death, restartable
    with pytest.raises(WorkerFailed) as raised:
        group(tmp_path).call("fail", "key then die", [0.0, 0.5])
    assert str(raised.value).startswith("tiny[1] failed in fail: the worker process died"), str(raised.value)


def test_a_stopped_worker_is_noticed_by_its_heartbeat_while_its_peers_long_call_is_not(ray_up, tmp_path):
    workers = group(tmp_path, heartbeat_timeout_s=2.0)
    stop_after_s = 5.0  # longer than the heartbeat timeout: a long call is not a silent worker
    threading.Timer(stop_after_s, os.kill, (workers.pids[1], signal.SIGSTOP)).start()
    began = time.monotonic()
    try:
        with pytest.raises(WorkerHang) as raised:
            workers.call("sleep", [60.0, 60.0])
    finally:
        if read_state(workers.pids[1]) != "gone":
            os.kill(workers.pids[1], signal.SIGCONT)
    seconds, error = time.monotonic() - began, raised.value
    # the timeout counts from the last beat before the stop (beats every timeout/6), then a look and the stacks
    assert stop_after_s + 2.0 - 2.0 / 6 - 0.1 <= seconds < stop_after_s + 30.0, seconds
    assert str(error).startswith(f"tiny: waited 2 s for a heartbeat from tiny[1] (pid {workers.pids[1]}: stopped (T))")
    assert str(error).endswith("in sleep (cluster.heartbeat_timeout_s=2)"), str(error)
    assert f"== Ray worker tiny[1] (pid {workers.pids[1]}) ==" in error.stacks


def test_a_call_has_one_deadline_in_all_not_one_per_finished_worker(ray_up, tmp_path):
    """Each worker finishes 1.5 s after the one before, within a 2 s timeout of each: the call still ends at 2 s."""
    workers = group(tmp_path, num_workers=3)
    workers.timeout_s = 2.0  # the calls' (the workers' processes started under the default)
    began = time.monotonic()
    with pytest.raises(WorkerHang) as raised:
        workers.call("sleep", [1.5, 3.0, 4.5])
    assert str(raised.value).startswith("tiny: waited 2 s for tiny[1], tiny[2] to finish sleep"), str(raised.value)
    assert time.monotonic() - began < 2.0 + 25.0  # the deadline and the stacks
