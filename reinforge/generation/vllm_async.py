"""In-flight generation on vLLM's `AsyncLLM`: the engine core in a process of its own, its weights updated while
requests run (`rollout.mode=in_flight` with `generation.backend=vllm`; the HF engine's waves are in_flight.py).

`AsyncVLLMEngine` holds the `AsyncLLM` client and an asyncio loop on a thread of its own; every caller (the rollout
workers, the agents' endpoint, validation, the refit) calls it from any thread and blocks on the loop's answer.

- `generate` sends each prompt as a request of its own (`AsyncLLM.generate`, FINAL_ONLY: a request's samples once
  all are done). vLLM's engine core batches every running request continuously: a request joins the batch at the
  next scheduler step and a finished one frees its slot at once.
- `receive_weights(version)` is vLLM's in-flight update: `pause_generation(mode="keep")` freezes the requests where
  they are, the weights come over the refit's wire (vLLM's weight-transfer protocol with reinforge's
  `reinforge_gloo` backend, generation/vllm_transfer.py: `start_weight_update`, `update_weights` until the sender's
  end header), the version labels the tokens sampled from then on
  (`finish_weight_update(version)`, vLLM's per-token `weight_versions` spans: `Completion.token_versions`), and
  `resume_generation` lets the same requests go on. Their KV cache is kept as the old weights computed it
  (`kv_cache="keep"`, as PipelineRL does), or with `"recompute"` dropped by the pause (`clear_cache=True`: vLLM
  preempts the running requests and refills their prompts and tokens so far with the new weights when it schedules
  them next); the logprobs already reported stay those of the version that sampled each token either way.
- `metrics()` gives, since its last call, the share of wall time with no request running (or the engine paused),
  `generation/idle_fraction`, the updates applied and the mean number of sequences per scheduler step (counted by
  a stat logger of vLLM's, which also counts `decoding_steps`).

In a run, the engine is a Ray actor that takes concurrent calls (cluster/generation_group.py's `InFlightGroup`);
the engine core is that actor's child process.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
from typing import Any, Callable

from reinforge.generation.base import GenerationResult, SamplingParams
from reinforge.generation.checkpoint_layout import has_modules, tied_names
from reinforge.generation.in_flight import KvCachePolicy, usage_metrics
from reinforge.generation.vllm_digests import checkpoint_names, served_adapter, served_weights
from reinforge.generation.vllm_engine_args import engine_arguments, model_facts
from reinforge.generation.vllm_images import check_expansion, vllm_prompt
from reinforge.generation.vllm_moe import check_refit_supported, padded_expert_width, repack_experts
from reinforge.generation.vllm_requests import vllm_completions, vllm_sampling_params
from reinforge.generation.vllm_support import engine_failure
from reinforge.generation.weight_digest import WeightDigests
from reinforge.hang import HangError


def pickled(worker, function: Callable, *args) -> bytes:
    """Run inside vLLM's worker: `function(worker, *args)`, pickled (a result of any type crosses vLLM's msgpack)."""
    return pickle.dumps(function(worker, *args))


def step_counter(engine: "AsyncVLLMEngine"):
    """A vLLM stat logger that counts the engine core's scheduler steps, and the sequences each ran, on `engine`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepCounter(StatLoggerBase):
        def __init__(self, vllm_config=None, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None and scheduler_stats.num_running_reqs:
                engine.count_step(scheduler_stats.num_running_reqs)

        def log_engine_initialized(self):
            pass

    return lambda vllm_config, engine_index: StepCounter()


class AsyncVLLMEngine:
    """A `GenerationBackend` on vLLM's `AsyncLLM` whose weights are updated while it generates (module docstring);
    `engine_kwargs`: `VLLMGenerationBackend`'s arguments (generation/vllm_config.py's `engine_kwargs`)."""

    def __init__(
        self, engine_kwargs: dict, kv_cache: KvCachePolicy = "keep", wait_timeout_s: float = 1800.0, version: int = 0
    ):
        self.kv_cache, self.wait_timeout_s, self.version = kv_cache, wait_timeout_s, version
        self.model_path = engine_kwargs["model_path"]
        self.route_experts = engine_kwargs.get("route_experts", False)
        self.lora_enabled = engine_kwargs.get("lora_rank") is not None
        self.adapter = None  # the LoRARequest of the adapter `load_adapter` loaded last, used by every request
        self.sent_names: list[str] = []  # the checkpoint names the last update sent
        self.decoding_steps = 0  # scheduler steps of the engine core that ran requests, since the start
        self._lock = threading.Lock()  # the counts, read by `metrics` from any thread
        self._counts = {"busy_s": 0.0, "steps": 0, "sequences": 0, "updates": 0}
        self._sequences, self._paused, self._next_id = 0, False, 0
        arguments = engine_arguments(**engine_kwargs, own_process=True)
        # our own functions run in the engine's workers (collective_rpc), and their results come back
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reinforge-async-vllm", daemon=True)
        self._thread.start()
        try:
            self._call(_start(self, arguments), "the engine to start")
        except Exception as error:  # one line naming the family and the engine (vllm_support.py)
            self._stop_loop()
            raise engine_failure(self.model_path, error) from error
        self._since = self._marked = time.perf_counter()  # the start-up is no idle time of the engine's

    # -- the GenerationBackend interface, callable from any thread --

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, images=None) -> GenerationResult:
        """`images`: each prompt's (a vision-language model's image prompts), or None."""
        images = images or [None] * len(prompt_token_ids)
        return GenerationResult(self._call(_generate(self, prompt_token_ids, params, images), "the engine to answer"))

    def init_weight_transfer(self, info: dict) -> None:
        """Join the refit's transfer group (generation/weight_transfer.py; returns once every member has)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=info)
        self._call(self.llm.init_weight_transfer_engine(request), "the engine to join the refit's wire")

    def receive_weights(self, version: int | None = None) -> None:
        """Take what the refit's sender broadcasts (in the checkpoint's layout) with the requests in flight kept,
        labelled `version` (default: the current one + 1); returns once the engine computes with them."""
        check_refit_supported(self.padded_experts)
        version = self.version + 1 if version is None else version
        self._call(_receive(self, version), "the engine to receive new weights")

    def transfer_ranks(self) -> int:
        """The engine's members of the transfer group: its tensor-parallel workers."""
        return self.llm.vllm_config.parallel_config.world_size

    def refit_layout(self):
        """What a sender makes of the trainer's weights for this engine (a `WireLayout`): the checkpoint's layout
        (checkpoint_layout.py), without the tied names it has no parameter of, in the dtype it computes in."""
        from reinforge.generation.weight_transfer import WireLayout

        dtype = str(self.llm.vllm_config.model_config.dtype).removeprefix("torch.")
        return WireLayout(self.model_path, tuple(self.untied_names), dtype)

    def set_version(self, version: int) -> None:
        """The version of the weights the engine computes with (the start-up or resume refit's): its tokens' label."""
        self._call(self.llm.update_weight_version(str(version)), "the engine's weight version")
        self.version = version

    def weight_digests(self, columns: int = 0, step: int = 0) -> list[WeightDigests]:
        """Each worker's digest of every weight it serves, its sampled columns (`column_sample`, weight_digest.py)."""
        names = self.sent_names or checkpoint_names(self.model_path, self.untied_names)
        return self._worker_call(served_weights, names, self.model_path, columns, step)

    def weight_layout(self) -> list[WeightDigests]:
        """Each worker's weights' names, shapes and dtypes, nothing hashed: what the expected side needs (once)."""
        names = checkpoint_names(self.model_path, self.untied_names)
        return self._worker_call(served_weights, names, self.model_path, 0, 0, False)

    def adapter_digests(self) -> list[WeightDigests]:
        """The digests of the LoRA adapter the engine generates with; none when no adapter is loaded."""
        loaded = self.adapter is not None and self.adapter.lora_int_id in self._call(self.llm.list_loras(), "loras")
        if not loaded:
            return [WeightDigests(engine="vllm engine")]
        return self._worker_call(served_adapter, self.adapter.lora_int_id)

    def load_adapter(self, path: str) -> None:
        """Generate with the PEFT adapter in directory `path` from now on (vllm_backend.py's `load_adapter`)."""
        from vllm.lora.request import LoRARequest

        assert self.lora_enabled, "load_adapter needs an engine built with lora_rank (model.lora.sync=adapter)"
        number = self.adapter.lora_int_id + 1 if self.adapter else 1
        request = LoRARequest(f"policy-{number}", number, path)
        assert self._call(self.llm.add_lora(request), "the engine to load an adapter"), f"vLLM did not load {path}"
        self.adapter = request
        self._call(_reset_caches(self), "the engine to reset its caches")

    def sleep(self) -> None:
        """Never: the engine keeps generating while the trainer works."""

    def close(self) -> None:
        """The engine stays up until `shutdown`."""

    def shutdown(self) -> None:
        self.llm.shutdown(timeout=0)  # nothing to drain: the engine core process ends now
        self._stop_loop()

    def metrics(self) -> dict[str, float]:
        """Since the last call: the share of wall time with nothing to compute, updates, mean sequences per step."""
        with self._lock:
            self._mark()
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            now, since, self._since = time.perf_counter(), self._since, time.perf_counter()
        return usage_metrics(counts, now - since)

    def count_step(self, sequences: int) -> None:
        """One scheduler step of the engine core that ran `sequences` (`step_counter`'s, on the loop's thread)."""
        with self._lock:
            self.decoding_steps += 1
            self._counts["steps"] += 1
            self._counts["sequences"] += sequences

    # -- the counts (on the loop, and `metrics` from any thread) --

    def _busy(self, sequences: int = 0, paused: bool | None = None) -> None:
        """The engine computes while a sequence runs and it is not paused: count the time until this change."""
        with self._lock:
            self._mark()
            self._sequences += sequences
            self._paused = self._paused if paused is None else paused

    def _mark(self) -> None:
        now = time.perf_counter()
        if self._sequences > 0 and not self._paused:
            self._counts["busy_s"] += now - max(self._marked, self._since)
        self._marked = now

    # -- callers' side --

    def _call(self, coroutine, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout=self.wait_timeout_s)
        except TimeoutError:
            future.cancel()
            raise HangError("in-flight engine", what, self.wait_timeout_s, "deadlines.rollout_wait_s").capture()

    def _worker_call(self, function: Callable, *args) -> list:
        """`function(worker, *args)` in every worker of the engine, between two scheduler steps."""
        call = self.llm.collective_rpc(pickled, args=(function, *args))
        results = self._call(call, f"the engine's {function.__name__}")
        return [pickle.loads(result) for result in results]

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)


# The engine's coroutines, on its loop. Not methods: Ray makes an actor with a coroutine method an asyncio actor,
# whose plain methods would then run on its event loop one at a time (the rollout workers' calls must not wait
# for each other).


async def _start(engine: "AsyncVLLMEngine", arguments: dict) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine.llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**arguments, disable_log_stats=True), stat_loggers=[step_counter(engine)]
    )
    engine._update_lock = asyncio.Lock()
    await engine.llm.update_weight_version(str(engine.version))  # tokens carry the version they were sampled by
    engine.padded_experts = (await engine.llm.collective_rpc(padded_expert_width))[0]
    # tied names the engine's model has no module of (Gemma's LM head is the embedding): never sent
    tied = list(tied_names(engine.model_path))
    has = (await engine.llm.collective_rpc(has_modules, args=(tied,)))[0]
    engine.untied_names = [name for name, present in zip(tied, has) if not present]
    engine.image_token, engine.num_experts = model_facts(engine.llm.model_config)


async def _generate(engine: "AsyncVLLMEngine", prompts: list[list[int]], params: SamplingParams, images: list) -> list:
    requests = [_request(engine, ids, params, i, inputs) for i, (ids, inputs) in enumerate(zip(prompts, images))]
    return list(await asyncio.gather(*requests))


async def _request(
    engine: "AsyncVLLMEngine", prompt_ids: list[int], params: SamplingParams, index: int, images
) -> list:
    request_id = f"inflight-{engine._next_id}"
    engine._next_id += 1
    sampling = vllm_sampling_params(params, index, images, engine.image_token, engine.route_experts)
    engine._busy(sequences=params.num_samples)
    try:
        async for output in engine.llm.generate(
            vllm_prompt(prompt_ids, images), sampling, request_id, lora_request=engine.adapter
        ):
            final = output
    finally:
        engine._busy(sequences=-params.num_samples)
    check_expansion(prompt_ids, images, final)
    return vllm_completions(final, index, params, engine.num_experts)


async def _receive(engine: "AsyncVLLMEngine", version: int) -> None:
    """vLLM's in-flight update: pause with the requests kept, the weights over the wire, the version, resume."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    from reinforge.generation.vllm_transfer import received_names

    async with engine._update_lock:
        recompute = engine.kv_cache == "recompute"
        # "recompute": the pause clears every cache, the running requests' KV too (vLLM preempts them)
        await engine.llm.pause_generation(mode="keep", clear_cache=recompute)
        engine._busy(paused=True)
        try:
            await engine.llm.start_weight_update()
            await engine.llm.update_weights(WeightTransferUpdateRequest(update_info={}))  # until the sender's end
            await engine.llm.finish_weight_update(str(version))  # labels the tokens sampled from now on
            engine.sent_names = (await engine.llm.collective_rpc(received_names))[0]
            await engine.llm.collective_rpc(repack_experts)  # vLLM-CPU's MoE kernel reads prepacked experts
            if not recompute:  # the prefix cache's blocks were computed with the old weights (running ones kept)
                await _reset_caches(engine)
            engine.version = version
            with engine._lock:
                engine._counts["updates"] += 1
        finally:
            await engine.llm.resume_generation()
            engine._busy(paused=False)


async def _reset_caches(engine: "AsyncVLLMEngine") -> None:
    await engine.llm.reset_prefix_cache()
    if engine.image_token is not None:  # image features the old weights computed (vllm_backend.py)
        await engine.llm.reset_encoder_cache()
