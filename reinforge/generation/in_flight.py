"""In-flight generation: an engine that never stops for training, its weights updated while requests run.

On vLLM it is `AsyncVLLMEngine` (generation/vllm_async.py: vLLM's `AsyncLLM` in a process of its own, updated
through `pause_generation(mode="keep")`, the weight load, `finish_weight_update(version)` and `resume_generation`).
Here is the HF engine's: `InFlightEngine` wraps an `HFGenerationBackend` and owns it on one thread of its own, the
driver. Every caller (the rollout workers, the agents' endpoint, validation, the refit) goes through it, from any
thread:

- `generate` queues its prompts and waits for their completions. The HF engine has no scheduler: the driver
  generates the waiting requests of one sampling setting together (a wave), and requests that arrive meanwhile
  wait for the next wave.
- `update_weights(weights, version)` (or `receive_weights(version)`, the same through the refit's wire) is applied
  by the driver between two decoding steps of the wave, the requests
  in flight kept, and returns once the engine computes with them. Tokens sampled from then on carry the new version;
  a sequence may span several (`Completion.token_versions`: the version of each decoding step). The KV cache of the
  tokens generated so far is kept as the old weights computed it (`kv_cache="keep"`, as PipelineRL does; dropping
  and recomputing it, `"recompute"`, is vLLM's alone); the logprobs already reported stay those of the version that
  sampled each token.
- `weight_digests`, `adapter_digests`, `load_adapter` run on the driver between steps too.

In a run, the engine is an `InFlightWorker` in a process of its own (a Ray actor that takes concurrent calls,
cluster/generation_group.py), so that it does not share the trainer's interpreter. `metrics()` gives, since its
last call, the share of wall time the engine had nothing to compute
(`generation/idle_fraction`), the updates applied and the mean number of sequences per step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Literal

import torch

from reinforge.generation.base import GenerationResult, SamplingParams
from reinforge.hang import HangError

KvCachePolicy = Literal["keep", "recompute"]


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    index: int  # in its caller's `generate` (its seed, as in a plain `generate`)
    future: Future  # -> list[Completion]
    images: Any = None  # its prompt's images (data/images.py `ImageInputs`), None: text only


def usage_metrics(counts: dict, wall_s: float) -> dict[str, float]:
    """An in-flight engine's `generation/*` metrics from its `counts` over `wall_s` seconds: the share of wall time
    with nothing to compute, the updates applied, the mean number of sequences per decoding step."""
    return {
        "generation/idle_fraction": max(0.0, 1.0 - counts["busy_s"] / max(wall_s, 1e-9)),
        "generation/weight_updates": float(counts["updates"]),
        "generation/sequences_per_step": counts["sequences"] / max(counts["steps"], 1),
    }


class InFlightEngine:
    """A `GenerationBackend` whose engine keeps generating while its weights are updated (module docstring)."""

    def __init__(self, engine, kv_cache: KvCachePolicy = "keep", wait_timeout_s: float = 1800.0, version: int = 0):
        self.engine, self.kv_cache, self.wait_timeout_s = engine, kv_cache, wait_timeout_s
        if kv_cache == "recompute":
            from reinforge.errors import ConfigError

            raise ConfigError(
                "rollout.in_flight_kv_cache=recompute needs generation.backend=vllm (the HF engine keeps the KV "
                "cache of a request in flight); set it to keep"
            )
        self.version = version  # of the weights the engine computes with
        self.decoding_steps = 0  # since the start: forwards of the running batch
        self._cond = threading.Condition()
        self._requests: deque[_Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._running: dict[str, _Request] = {}  # the requests of the wave in the engine
        self._next_id = 0
        self._stopping = False
        self._counts = {"busy_s": 0.0, "steps": 0, "sequences": 0, "updates": 0}
        self._since = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="reinforge-in-flight-engine", daemon=True)
        self._thread.start()

    # -- the GenerationBackend interface, callable from any thread --

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, images=None) -> GenerationResult:
        """`images`: each prompt's (a vision-language model's image prompts), or None."""
        images = images or [None] * len(prompt_token_ids)
        requests = [
            _Request(ids, params, index, Future(), inputs)
            for index, (ids, inputs) in enumerate(zip(prompt_token_ids, images))
        ]
        with self._cond:
            self._check_open()
            self._requests.extend(requests)
            self._cond.notify_all()
        completions = [self._result(request.future, "the engine to finish a request") for request in requests]
        for index, samples in enumerate(completions):
            for completion in samples:
                completion.prompt_index = index
        return GenerationResult(completions)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load new weights between two decoding steps (default version: the current one + 1); returns once the
        engine computes with them."""
        weights = list(named_tensors)  # gathered on the caller's thread
        version = self.version + 1 if version is None else version
        self._call(lambda: self._load(lambda: self.engine.update_weights(weights), version), "new weights")

    def receive_weights(self, version: int | None = None) -> None:
        """`update_weights` through the refit's wire (generation/weight_transfer.py): the driver receives between two
        decoding steps while the sender sends."""
        version = self.version + 1 if version is None else version
        self._call(lambda: self._load(self.engine.receive_weights, version), "the engine to receive new weights")

    def init_weight_transfer(self, info: dict) -> None:
        """Join the refit's transfer group (the engine's weights are not touched: the driver keeps generating)."""
        self.engine.init_weight_transfer(info)

    def transfer_ranks(self) -> int:
        return self.engine.transfer_ranks()

    def refit_layout(self):
        return self.engine.refit_layout()

    def weight_digests(self, columns: int = 0, step: int = 0):
        return self._call(lambda: self.engine.weight_digests(columns, step), "the engine's weight digests")

    def weight_layout(self):
        return self._call(self.engine.weight_layout, "the engine's weight layout")

    def adapter_digests(self):
        return self._call(self.engine.adapter_digests, "the engine's adapter digests")

    def load_adapter(self, path: str) -> None:
        self._call(lambda: self.engine.load_adapter(path), "the engine to load an adapter")

    def sleep(self) -> None:
        """Never: the engine keeps generating while the trainer works."""

    def close(self) -> None:
        """Stop the driver (requests still waiting fail); the engine itself stays up."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def shutdown(self) -> None:
        self.close()
        self.engine.shutdown()

    def metrics(self) -> dict[str, float]:
        """Since the last call: the share of wall time with nothing to compute, updates, mean sequences per step."""
        with self._cond:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            now, since, self._since = time.perf_counter(), self._since, time.perf_counter()
        return usage_metrics(counts, now - since)

    # -- callers' side --

    def _check_open(self) -> None:
        if self._stopping:
            raise RuntimeError("the in-flight engine is shut down")

    def _result(self, future: Future, what: str):
        try:
            return future.result(timeout=self.wait_timeout_s)
        except TimeoutError:
            raise HangError("in-flight engine", what, self.wait_timeout_s, "deadlines.rollout_wait_s").capture()

    def _call(self, command: Callable[[], Any], what: str):
        """Run `command` on the driver between two decoding steps and return its result."""
        future: Future = Future()
        with self._cond:
            self._check_open()
            self._commands.append((command, future))
            self._cond.notify_all()
        return self._result(future, what)

    # -- the driver --

    def _load(self, load: Callable[[], None], version: int) -> None:
        load()
        self.version = version
        self._counts["updates"] += 1

    def _run_commands(self) -> None:
        with self._cond:
            commands, self._commands = list(self._commands), deque()
        for command, future in commands:
            try:
                future.set_result(command())
            except BaseException as error:  # the caller raises it
                future.set_exception(error)

    def _has_work(self) -> bool:
        return bool(self._stopping or self._requests or self._commands or self._running)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._stopping:
                    self._fail_all(RuntimeError("the in-flight engine shut down before answering"))
                    return
            self._run_commands()
            try:
                self._wave()
            except BaseException as error:  # every waiting caller learns why
                with self._cond:
                    self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for request in [*self._requests, *self._running.values()]:
            if not request.future.done():
                request.future.set_exception(error)
        self._requests.clear()
        self._running.clear()

    def _wave(self) -> None:
        """HF: the oldest waiting request and every other of its sampling settings, generated together; new
        weights are loaded between its decoding steps."""
        with self._cond:
            if not self._requests:
                return
            key = replace(self._requests[0].params, seed=0)
            wave = [r for r in self._requests if replace(r.params, seed=0) == key]
            self._requests = deque(r for r in self._requests if replace(r.params, seed=0) != key)
            self._running = {str(i): request for i, request in enumerate(wave)}  # failed together if it fails
        params = replace(wave[0].params, seed=wave[0].params.seed + 7_919 * self._next_id)
        self._next_id += 1
        started = time.perf_counter()
        steps = [0]

        def between_steps() -> int:
            version = self.version  # the weights that computed this step's logits
            steps[0] += 1
            self.decoding_steps += 1
            self._run_commands()
            return version

        images = [r.images for r in wave]
        result = self.engine.generate(
            [r.prompt_ids for r in wave],
            params,
            images=images if any(i is not None for i in images) else None,
            on_step=between_steps,
        )
        sequences = sum(r.params.num_samples for r in wave)
        self._count(time.perf_counter() - started, sequences, steps[0])
        for request, completions in zip(wave, result.completions):
            request.future.set_result(list(completions))
        self._running = {}

    def _count(self, seconds: float, sequences: int, steps: int = 1) -> None:
        with self._cond:
            self._counts["busy_s"] += seconds
            self._counts["steps"] += steps
            self._counts["sequences"] += sequences * steps


class InFlightWorker(InFlightEngine):
    """An `InFlightEngine` that builds its own engine (`engine_cls(**engine_kwargs)`): what runs in a process of its
    own (cluster/generation_group.py's InFlightGroup), the calls of every caller arriving on threads of its own."""

    def __init__(self, engine_cls: type, engine_kwargs: dict, kv_cache: KvCachePolicy, wait_timeout_s: float):
        super().__init__(engine_cls(**engine_kwargs), kv_cache, wait_timeout_s)

    def set_version(self, version: int) -> None:
        """The version of the weights the engine computes with (the start-up or resume refit's)."""
        self.version = version
