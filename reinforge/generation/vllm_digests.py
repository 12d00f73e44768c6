"""What a vLLM engine worker serves, for the refit check (generation/weight_digest.py): run inside each worker
through `collective_rpc`.

On CPU vLLM frees a linear layer's parameter once oneDNN has packed it, so those weights are read back through the
layer's own kernel (`read_back`): identity rows at the digest's sampled input columns only (`column_sample`), so the
read-back costs N x K x columns, not N x K x K; vLLM's `compute_weight_checksums` would hash the empty parameters
there. The engine's layout alone (`served_layout`: names, shapes, dtypes, the names its model renames) is fetched
once, for the expected side (`Expectation`), without hashing anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reinforge.generation.checkpoint_layout import engine_names, tied_names
from reinforge.generation.vllm_moe import expert_prepack_isa
from reinforge.generation.weight_digest import WeightDigests, column_sample, report, tp_worker


def input_size(module: torch.nn.Module) -> int:
    """K of a vLLM layer whose weight is freed: a tensor-parallel shard's, a replicated layer's (a MoE router), an
    LM head's."""
    return (
        getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None) or module.embedding_dim
    )


def read_back(module: torch.nn.Module, columns: slice | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """The [N, K] weight a vLLM-CPU linear layer computes with, its input columns `columns` only (all of them when
    None), read back through its own GEMM kernel (`cpu_linear`, oneDNN's packed copy; the parameter itself is
    freed): identity rows in, W^T out, exact because each output is one weight times 1 plus zeros; and (N, K)."""
    weight = module.weight
    k = weight.shape[1] if weight.numel() else input_size(module)
    picked = torch.arange(k)[columns if columns is not None else slice(None)]
    blocks = []
    for start in range(0, len(picked), 1024):
        rows = picked[start : start + 1024]
        eye = torch.zeros(len(rows), k, dtype=weight.dtype)
        eye[torch.arange(len(rows)), rows] = 1
        blocks.append(module.cpu_linear(eye, weight, None))
    sampled = torch.cat(blocks).T
    return sampled, (sampled.shape[0], k)


def served_weights(
    worker, sent_names: list[str] = (), checkpoint_model: str | None = None, columns: int = 0, step: int = 0,
    digests: bool = True,
) -> WeightDigests:  # fmt: skip
    """Run inside vLLM's worker: the digest of every weight as the engine computes with it, its sampled columns
    (`columns`, `step`: weight_digest.column_sample), in vLLM's names (fused qkv_proj/gate_up_proj, the padded
    vocabulary; a tied lm_head under its own name), with what the refit check needs to build them from
    `sent_names` (the checkpoint names of `checkpoint_model` the refit sends; names the model's own mapping
    renames, `engine_names`). `digests` False: the layout alone, nothing hashed."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = worker.model_runner.get_model()
    weights, presampled = [], {}
    for module_name, module in model.named_modules():
        # On CPU, linear layers and the LM head compute through `cpu_linear`; an embedding looks its weight up.
        gemm = hasattr(module, "cpu_linear") and (
            isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding)
        )
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}".replace(".base_layer.", ".")
            if gemm and leaf == "weight":  # the layout alone: one column tells N
                k = param.shape[1] if param.numel() else input_size(module)
                sample = column_sample((k,), columns, step) if digests else slice(0, 1)
                param, presampled[name] = read_back(module, sample)
            weights.append((name, param))
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    packed = getattr(model, "packed_modules_mapping", {})
    served = report(
        "vllm engine", weights, packed, rank, size, expert_prepack_isa(model), columns, step, presampled, digests
    )  # fmt: skip
    served.engine = "vllm engine" if size == 1 else f"vllm engine {tp_worker(served)}"
    served.checkpoint_model = checkpoint_model
    served.renames, served.expert_names = engine_names(model, sent_names)
    return served


def checkpoint_names(model_path: str, untied: list[str]) -> list[str]:
    """The names a refit sends an engine of `model_path` (checkpoint_layout.py): the checkpoint's own tensors (its
    safetensors headers), its tied names (sent under both), but `untied` (tied names the engine has no module of)."""
    from safetensors import safe_open

    names = []
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as checkpoint:
            names += list(checkpoint.keys())
    names += [name for name in tied_names(model_path) if name not in names]
    return [name for name in names if name not in set(untied)]


def served_adapter(worker, adapter_id: int) -> WeightDigests:
    """Run inside vLLM's worker: the digests of the LoRA tensors vLLM holds for adapter `adapter_id` (none when
    it is not loaded), as `MODULE.lora_a` / `MODULE.lora_b` per target module (a packed qkv_proj's parts under
    their own names), B with its scaling applied as vLLM computes with it."""
    manager = worker.model_runner.lora_manager._adapter_manager
    lora = manager.get_adapter(adapter_id)
    tensors = []
    for module, weights in (lora.loras if lora is not None else {}).items():
        parent, _, last = module.rpartition(".")
        packed = isinstance(weights.lora_a, list)
        names = [f"{parent}.{part}" for part in manager.packed_modules_mapping[last]] if packed else [module]
        parts = zip(
            names,
            weights.lora_a if packed else [weights.lora_a],
            weights.lora_b if packed else [weights.lora_b],
            weights.scaling if packed else [weights.scaling],
        )
        for name, lora_a, lora_b, scaling in parts:
            if lora_a is not None:
                tensors += [
                    (f"{name}.lora_a", lora_a),
                    (f"{name}.lora_b", lora_b if scaling == 1 else lora_b * scaling),
                ]
    return report("vllm engine", tensors)
