"""`generation.vllm`: the vLLM engine's settings, read only with `generation.backend=vllm` (generation/base.py
refuses them with another engine), and the engine's arguments (`engine_kwargs`) built from the sections it reads.
"""

from __future__ import annotations

from pydantic import Field

from reinforge.config.section import Section
from reinforge.model_config import ModelConfig, adapter_sync


class VLLMConfig(Section):
    """`generation.vllm`: how each vLLM engine is built (vllm_backend.py's `VLLMGenerationBackend`)."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel workers of each vLLM engine, whatever the trainer's layout (the refit sends whole tensors;
    each worker loads its shards, and the refit check hashes each worker's shards). On CPU each worker gets an
    equal share of the cores; on GPU one GPU each."""
    max_model_len: int | None = Field(default=None, ge=1)
    """vLLM's context length; null: the longest sequence a rollout can make (data.max_prompt_tokens +
    generation.max_new_tokens, with every turn and observation of a multi-turn rollout)."""
    enforce_eager: bool | None = None
    """Disable vLLM's torch.compile/CUDA graphs; null: eager on CPU (compiling costs ~35 s there), compiled on GPU."""
    block_size: int | None = None
    """Tokens per vLLM KV-cache block; null: vLLM's default (128 on CPU, 16 on GPU). On CPU (a multiple of 32
    there) 32 suits short sequences: the CPU attention kernel computes whole blocks, and the demo model
    generates 1.4x faster with 32 than with 128 (docs/benchmarks.md)."""
    cpu_kv_cache_gb: int = 1
    """vLLM KV-cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take for weights and KV cache (the trainer needs the rest when colocated)."""
    sleep_mode: bool | None = None
    """Put vLLM to sleep while the trainer works (weights offloaded to CPU memory, KV cache freed) and
    wake it for the refit and the next rollout, so training and generation share a GPU's memory in
    turns; null: on when a GPU is present, off on CPU (where vLLM has no sleep mode)."""


# What `generation.vllm_*` was called before it had a section of its own, for the unknown-key error.
MOVED_VLLM_KEYS = {f"generation.vllm_{name}": f"generation.vllm.{name}" for name in VLLMConfig.model_fields}


def engine_kwargs(model: ModelConfig, vllm: VLLMConfig, seed: int, longest_sequence: int) -> dict:
    """`VLLMGenerationBackend` arguments (in-process engine or Ray actor alike) for `model`, seeded with `seed`;
    `longest_sequence`: the longest sequence the run makes, the context length unless `vllm.max_model_len`."""
    from reinforge.modeling import model_location, moe_lora_targets  # transformers, where an engine is built

    sync = adapter_sync(model.lora, "vllm")
    return dict(
        model_path=model_location(model),
        dtype=model.dtype,
        seed=seed,
        max_model_len=vllm.max_model_len or longest_sequence,
        enforce_eager=vllm.enforce_eager,
        block_size=vllm.block_size,
        cpu_kv_cache_gb=vllm.cpu_kv_cache_gb,
        gpu_memory_utilization=vllm.gpu_memory_utilization,
        sleep_mode=vllm.sleep_mode,
        tensor_parallel_size=vllm.tensor_parallel_size,
        lora_rank=model.lora.rank if sync else None,
        lora_targets=moe_lora_targets(model) if sync else None,
        route_experts=model.moe.router_replay == "rollout",
    )
