"""Concurrent requests batched into the generation engine.

Agents call the endpoint one conversation at a time; the engine is fast only on batches. A single
thread owns the engine: it takes every waiting request that shares the first one's sampling settings
(up to `max_batch_size` sequences) and makes one `generate` call of them. It starts a call once no
request has arrived for `batch_wait_s` (or the oldest has waited MAX_WAITS x that), at once when every agent
known to be running is already waiting (`num_waiting_hint`): waiting longer could only add latency.
A request with a seed of its own is generated alone, so that the seed alone decides its sample. An engine that
takes concurrent calls (the in-flight engine, generation/in_flight.py) gets up to `max_concurrent_calls` batches
at once, each on a thread of its own: a batch joins the engine's running requests instead of waiting for the
previous batch's longest answer.

Bounded: at most `max_queued` requests wait for the engine; `submit` refuses one more with `QueueFull` (HTTP 429,
its Retry-After the seconds of the last engine call, at least 1), so that clients faster than the engine slow down
instead of growing the queue (and the endpoint's memory) without bound.

Deadlines: a request whose waiter gave up (serving/app.py answers 504 after `request_timeout_s`, cancelling its
future) is dropped if the engine has not started it (a closing rollout session waits for its own calls at most
`request_timeout_s`, serving/server.py).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable

from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.serving.errors import QueueFull

MAX_WAITS = 10  # the oldest waiting request is generated after at most MAX_WAITS x batch_wait_s


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    alone: bool  # its own seed: generated in a call of its own
    future: Future  # -> list[Completion]: `params.num_samples` of them
    images: Any = None  # its prompt's images (data/images.py `ImageInputs`), None: text only

    def key(self) -> tuple:
        return (id(self),) if self.alone else (replace(self.params, seed=0),)


class Batcher:
    def __init__(
        self,
        engine: GenerationBackend,
        max_batch_size: int,
        batch_wait_s: float,
        num_waiting_hint: Callable[[], int] | None = None,
        *,
        request_timeout_s: float,
        max_concurrent_calls: int = 1,
        max_queued: int = 1024,
    ):
        self.engine, self.max_batch_size, self.batch_wait_s = engine, max_batch_size, batch_wait_s
        self.max_concurrent_calls = max_concurrent_calls
        self.request_timeout_s, self.max_queued = request_timeout_s, max_queued
        self._last_call_s = 0.0  # the last engine call's seconds: a refused client's Retry-After
        self.num_waiting_hint = num_waiting_hint or (lambda: 0)
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._first_arrival = self._last_arrival = 0.0
        self._running = 0  # engine calls under way
        self._stopping = False
        self._num_calls = 0
        self.counts = {"engine_calls": 0, "sequences": 0, "max_batch_sequences": 0, "engine_s": 0.0}
        self._thread = threading.Thread(target=self._run, name="reinforge-endpoint-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, alone: bool = False, images: Any = None) -> Future:
        """A future of the request's `params.num_samples` completions; `images`: its prompt's (data/images.py)."""
        request = _Request(prompt_ids, params, alone, Future(), images)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the endpoint is shutting down")
            if len(self._pending) >= self.max_queued:
                retry_after_s = max(1, math.ceil(self._last_call_s))
                raise QueueFull(
                    f"{self.max_queued} requests are already waiting for the engine (max_queued_requests); "
                    f"retry after {retry_after_s} s",
                    retry_after_s,
                )
            if not self._pending:
                self._first_arrival = time.monotonic()
            self._pending.append(request)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        return request.future

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _ready(self) -> bool:
        waiting, running_agents = len(self._pending), self.num_waiting_hint()
        if waiting >= self.max_batch_size or (running_agents and waiting >= running_agents):
            return True
        now = time.monotonic()
        return (
            now - self._last_arrival >= self.batch_wait_s or now - self._first_arrival >= MAX_WAITS * self.batch_wait_s
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (self._pending and self._running < self.max_concurrent_calls) or self._stopping
                )
                while not self._stopping and not self._ready():
                    self._cond.wait(
                        timeout=max(
                            min(
                                self._last_arrival + self.batch_wait_s,
                                self._first_arrival + MAX_WAITS * self.batch_wait_s,
                            )
                            - time.monotonic(),
                            1e-4,
                        )
                    )
                if self._stopping:
                    for request in self._pending:
                        if request.future.set_running_or_notify_cancel():  # not given up on
                            request.future.set_exception(RuntimeError("the endpoint shut down before answering"))
                    self._pending.clear()
                    self._cond.notify_all()
                    return
                batch, number = self._take_batch(), self._num_calls
                self._num_calls += 1
                self._running += 1
            if self.max_concurrent_calls == 1:
                self._call(batch, number)
            else:
                threading.Thread(
                    target=self._call, args=(batch, number), name="reinforge-endpoint-call", daemon=True
                ).start()

    def _call(self, batch: list[_Request], number: int) -> None:
        try:
            self._generate(batch, number)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _take_batch(self) -> list[_Request]:
        """The oldest request and those waiting with the same settings, up to `max_batch_size` sequences."""
        key = self._pending[0].key()
        batch, rest, num_sequences = [], [], 0
        for request in self._pending:
            fits = num_sequences + request.params.num_samples <= self.max_batch_size or not batch
            if request.key() == key and fits:
                batch.append(request)
                num_sequences += request.params.num_samples
            else:
                rest.append(request)
        self._pending = rest
        self._first_arrival = time.monotonic() if rest else 0.0
        # from here on a request cannot be cancelled; one whose waiter gave up (timed out) is dropped
        return [request for request in batch if request.future.set_running_or_notify_cancel()]

    def _generate(self, batch: list[_Request], number: int) -> None:
        """Engine call `number` (its seed stream) of the batch."""
        if not batch:
            return
        params = batch[0].params
        if not batch[0].alone:  # a fresh, reproducible stream per engine call
            params = replace(params, seed=params.seed + 7_919 * number)
        started = time.perf_counter()
        try:
            prompts = [request.prompt_ids for request in batch]
            images = [request.images for request in batch]
            if any(i is not None for i in images):  # only engines of a vision-language model take images
                result = self.engine.generate(prompts, params, images=images)
            else:
                result = self.engine.generate(prompts, params)
        except BaseException as exc:  # every waiting request learns why; the endpoint stays up
            for request in batch:
                request.future.set_exception(exc)
            return
        num_sequences = sum(len(completions) for completions in result.completions)
        with self._cond:
            self._last_call_s = time.perf_counter() - started
            self.counts["engine_s"] += self._last_call_s
            self.counts["engine_calls"] += 1
            self.counts["sequences"] += num_sequences
            self.counts["max_batch_sequences"] = max(self.counts["max_batch_sequences"], num_sequences)
        for request, completions in zip(batch, result.completions):
            request.future.set_result(list(completions))

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (engine_s: seconds in the engine), then reset."""
        with self._cond:
            counts, self.counts = dict(self.counts), dict.fromkeys(self.counts, 0)
        calls = counts["engine_calls"]
        return {
            **{k: float(v) for k, v in counts.items()},
            "mean_batch_sequences": counts["sequences"] / calls if calls else 0.0,
        }
