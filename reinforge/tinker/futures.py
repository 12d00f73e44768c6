"""Futures and the device's queue.

Every training or sampling request is answered at once with a request id (the SDK's `UntypedAPIFuture`); the work
runs later on ONE worker thread, the only thread that touches models and engines. The worker picks fairly:
round-robin over sessions (two clients interleave, neither starves), and within a session the oldest runnable job.
A job bound to a model runs only when its `seq_id` is the model's next one: the SDK numbers a training client's
requests and may send them out of order (forward_backward's chunks go in parallel, the first one last), and
Tinker's contract is that they run in the order of those numbers.

`FutureStore` keeps each request's state (pending, done with a JSON or protobuf payload, failed with a message
and a category) and lets `retrieve_future` wait for it without a thread per poll.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from reinforge.network import one_line
from reinforge.tinker.errors import QueueFull, TinkerRequestError, UnknownResource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Payload:
    """A finished request's answer: a JSON object, or protobuf bytes (forward_backward's and sample's results)."""

    body: dict[str, Any] | bytes

    @property
    def is_proto(self) -> bool:
        return isinstance(self.body, bytes)


@dataclass
class _Record:
    session_id: str
    payload: Payload | None = None
    error: tuple[str, str] | None = None  # (message, category: "user" | "server")
    finished_at: float | None = None
    retrieved_at: float | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)


class FutureStore:
    """Request id -> its state. Thread-safe: the worker finishes records, the HTTP event loop reads them."""

    def __init__(self, result_ttl_s: float) -> None:
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()
        self._ttl = result_ttl_s

    def create(self, session_id: str) -> str:
        request_id = uuid.uuid4().hex
        with self._lock:
            self._records[request_id] = _Record(session_id)
        return request_id

    def session_of(self, request_id: str) -> str | None:
        record = self._records.get(request_id)
        return record.session_id if record is not None else None

    def finish(self, request_id: str, payload: Payload) -> None:
        self._complete(request_id, payload=payload)

    def fail(self, request_id: str, message: str, category: str = "user") -> None:
        self._complete(request_id, error=(message, category))

    def _complete(self, request_id: str, payload: Payload | None = None, error: tuple[str, str] | None = None):
        with self._lock:
            record = self._records.get(request_id)
            if record is None or record.finished_at is not None:
                return
            record.payload, record.error, record.finished_at = payload, error, time.monotonic()
            waiters, record.waiters = record.waiters, []
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_wake, waiter)

    async def wait(self, request_id: str, timeout_s: float) -> _Record | None:
        """The record once finished, or None when it is still pending after `timeout_s`."""
        loop = asyncio.get_running_loop()
        with self._lock:
            record = self._records.get(request_id)
            if record is None:
                raise UnknownResource(
                    f"unknown request id {request_id!r}: this server never issued it, or its result expired "
                    "(results are kept tinker.result_ttl_s after they are first retrieved)"
                )
            if record.finished_at is None:
                waiter = loop.create_future()
                record.waiters.append((loop, waiter))
        if record.finished_at is None:
            try:
                await asyncio.wait_for(waiter, timeout_s)
            except asyncio.TimeoutError:
                with self._lock:
                    if (loop, waiter) in record.waiters:
                        record.waiters.remove((loop, waiter))
                return None
        with self._lock:
            record.retrieved_at = record.retrieved_at or time.monotonic()
        self._expire()
        return record

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [rid for rid, r in self._records.items() if r.retrieved_at and now - r.retrieved_at > self._ttl]
            for rid in stale:
                del self._records[rid]

    def drop_session(self, session_id: str, reason: str) -> None:
        """Fail the session's pending requests with `reason` (its results already finished stay retrievable)."""
        with self._lock:
            pending = [rid for rid, r in self._records.items() if r.session_id == session_id and not r.finished_at]
        for rid in pending:
            self.fail(rid, reason)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class Job:
    """One request's device work: `run()` returns its payload; it may raise `TinkerRequestError` (a failed future
    the user caused) or anything else (a server error, logged)."""

    request_id: str
    session_id: str
    run: Callable[[], Payload]
    model_id: str | None = None  # ordered: runs when seq_id is the model's next
    seq_id: int | None = None
    kind: str = ""
    batch_key: Hashable | None = None  # queued jobs with equal keys run as one call of `run_batch` (samples)
    run_batch: Callable[[list["Job"]], list[Payload]] | None = None
    args: Any = None  # what `run_batch` needs of this job


class Scheduler:
    """The device's queue and its one worker thread."""

    def __init__(self, futures: FutureStore, max_queued: int, max_batch: int = 64, batch_wait_s: float = 0.02) -> None:
        self.futures = futures
        self.max_queued = max_queued
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s  # how long a batchable job waits for the others of its batch to arrive
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # session -> its jobs; order = round-robin
        self._next_seq: dict[str, int] = {}
        self._skipped: dict[str, set[int]] = {}
        self._queued = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="reinforge-tinker-worker", daemon=True)
        self.busy_s = 0.0  # time spent running jobs, for the logs and benchmarks
        self.busy_by_kind: dict[str, float] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def register_model(self, model_id: str, next_seq: int) -> None:
        with self._cond:
            self._next_seq[model_id] = next_seq
            self._skipped[model_id] = set()

    def forget_model(self, model_id: str) -> None:
        with self._cond:
            self._next_seq.pop(model_id, None)
            self._skipped.pop(model_id, None)

    def skip(self, model_id: str, seq_id: int | None) -> None:
        """A request of the model that was refused before it queued: its number must not hold up the next ones."""
        if seq_id is None:
            return
        with self._cond:
            if model_id in self._skipped:
                self._skipped[model_id].add(seq_id)
                self._cond.notify_all()

    def submit(self, job: Job, force: bool = False) -> None:
        """Queue `job`; `QueueFull` (HTTP 429, which the SDK retries) when `max_queued` jobs wait already."""
        with self._cond:
            if self._queued >= self.max_queued and not force:
                raise QueueFull(
                    f"the server's queue holds {self._queued} requests (tinker.max_queued_requests); retry shortly"
                )
            self._queues.setdefault(job.session_id, deque()).append(job)
            self._queued += 1
            self._cond.notify_all()

    def drop_session(self, session_id: str, reason: str) -> None:
        """Forget the session's queued jobs (their futures fail with `reason`)."""
        with self._cond:
            jobs = self._queues.pop(session_id, deque())
            self._queued -= len(jobs)
        for job in jobs:
            self.futures.fail(job.request_id, reason)

    def queued(self) -> int:
        with self._cond:
            return self._queued

    def _runnable(self, job: Job) -> bool:
        if job.model_id is None or job.seq_id is None:
            return True
        expected = self._next_seq.get(job.model_id)
        if expected is None:
            return True  # its model is gone: run it, to fail it
        skipped = self._skipped[job.model_id]
        while expected in skipped:
            skipped.discard(expected)
            expected += 1
        self._next_seq[job.model_id] = expected
        return job.seq_id <= expected  # below: a resubmission; run it rather than hold it forever

    def _pick(self) -> Job | None:
        for session_id, jobs in list(self._queues.items()):
            for job in jobs:
                if self._runnable(job):
                    jobs.remove(job)
                    self._queued -= 1
                    self._queues.move_to_end(session_id)  # the next pick starts with the other sessions
                    if not jobs:
                        del self._queues[session_id]
                    return job
        return None

    def _batch(self, first: Job) -> list[Job]:
        """`first` and the queued jobs that can share its call (same `batch_key`), oldest first, including those that
        arrive within `batch_wait_s` (a client sends an RL step's prompts at once, a few ms apart). Called with the
        lock held."""
        batch = [first]
        if first.batch_key is None:
            return batch
        deadline = time.monotonic() + self.batch_wait_s
        self._take_matching(batch)
        while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(timeout=left)
            self._take_matching(batch)
        return batch

    def _take_matching(self, batch: list[Job]) -> None:
        for session_id, jobs in list(self._queues.items()):
            for job in list(jobs):
                if len(batch) < self.max_batch and job.batch_key == batch[0].batch_key:
                    jobs.remove(job)
                    self._queued -= 1
                    batch.append(job)
            if not jobs:
                del self._queues[session_id]

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._pick()
                while job is None and not self._stopping:
                    self._cond.wait(timeout=1.0)
                    job = self._pick()
                if job is None:
                    return
                batch = self._batch(job)
            if len(batch) > 1:
                self._run_batch(batch)
            else:
                self._run(job)
            if job.model_id is not None and job.seq_id is not None:
                with self._cond:
                    if job.model_id in self._next_seq:
                        self._next_seq[job.model_id] = max(self._next_seq[job.model_id], job.seq_id + 1)
                    self._cond.notify_all()

    def _run_batch(self, jobs: list[Job]) -> None:
        start = time.monotonic()
        try:
            payloads = jobs[0].run_batch(jobs)
        except Exception:  # one bad request must not fail the others: each runs on its own, and fails alone
            logger.info("a batch of %d %s requests failed; running them one by one", len(jobs), jobs[0].kind)
            for job in jobs:
                self._run(job)
            return
        for job, payload in zip(jobs, payloads, strict=True):
            self.futures.finish(job.request_id, payload)
        spent = time.monotonic() - start
        self.busy_s += spent
        self.busy_by_kind[jobs[0].kind] = self.busy_by_kind.get(jobs[0].kind, 0.0) + spent

    def _run(self, job: Job) -> None:
        start = time.monotonic()
        try:
            payload = job.run()
        except TinkerRequestError as exc:
            self.futures.fail(job.request_id, one_line(exc), "user")
        except Exception as exc:  # the server's fault: logged here, one line for the client
            logger.exception("tinker request %s (%s) failed", job.request_id, job.kind)
            self.futures.fail(job.request_id, f"internal server error in {job.kind}: {one_line(exc)}", "server")
        else:
            self.futures.finish(job.request_id, payload)
        finally:
            spent = time.monotonic() - start
            self.busy_s += spent
            self.busy_by_kind[job.kind] = self.busy_by_kind.get(job.kind, 0.0) + spent
