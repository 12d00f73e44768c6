"""The sent tensor behind each weight an engine serves, in the engine's layout (for the refit check,
weight_digest.py): the tensor of its own name, or a fused parameter's parts (vLLM's `packed_modules_mapping`,
e.g. q/k/v -> qkv_proj) concatenated along dim 0 in mapping order; of a tensor-parallel worker, its shard; cast
to the engine's dtype, a padded vocabulary dimension zero-padded to the engine's shape. A mixture-of-experts
layer's experts (vLLM's `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I]) come from the sent experts stacked as
transformers holds them (`gate_up_proj` / `down_proj`; `expert_tensor`: each tensor-parallel worker's slice of the
gate and of the up half, the intermediate size zero-padded to the engine's), prepacked as vLLM-CPU holds them
(generation/vllm_moe.py).

A sample of the last dimension's columns (weight_digest.column_sample) is taken from the sent tensors before any
of this where it commutes with it (`engine_tensor`), so the check copies and casts only the sample.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch


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
    if shape[dim] * size == tensor.shape[dim]:  # no padding: a view
        return tensor.narrow(dim, rank * shape[dim], shape[dim])
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


def fused_parts(name: str, packed: dict[str, list[str]]) -> list[str]:
    """The sent names a fused engine weight `name` is made of (`X.qkv_proj.weight`: `X.q_proj.weight`, ...); none
    when it is not fused."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    return [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in packed.get(last, [])]


def source_tensor(
    name: str, sent: Mapping[str, torch.Tensor], packed: dict[str, list[str]], rank: int = 0, size: int = 1,
    rows: int | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """The sent tensor behind engine weight `name`: itself, or a fused weight's parts concatenated (dim 0); of an
    engine of `size` tensor-parallel workers, worker `rank`'s shard of it (a fused weight: each part's, in order,
    `column_shards` of the `rows` it holds)."""
    if name in sent:
        return sent[name]
    parts = fused_parts(name, packed)
    if parts and all(part in sent for part in parts):
        pieces = [sent[part].detach() for part in parts]
        if size > 1:  # column-parallel: each part split over the workers
            pieces = column_shards(pieces, rows, rank, size)
        return None if pieces is None else torch.cat(pieces)
    return None


EXPERT_WEIGHT = re.compile(r"^(?P<experts>.*\.experts)(?:\.routed_experts)?\.(?P<kind>w13|w2)_weight$")


def expert_source(name: str) -> str | None:
    """The sent name of the transformers-layout experts behind vLLM fused-MoE weight `name`; None if it is none."""
    match = EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    return f"{match['experts']}.{'gate_up_proj' if match['kind'] == 'w13' else 'down_proj'}"


def expert_tensor(name: str, sent: Mapping[str, torch.Tensor], shape: tuple[int, ...], rank: int, size: int):
    """The tensor behind a vLLM fused-MoE weight (`X.experts[.routed_experts].w13_weight` [E, 2P, H] or
    `w2_weight` [E, H, P]) from the sent fused `X.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) or
    `X.experts.down_proj` [E, H, I]: worker `rank` of `size` holds the rank-th 1/size of the intermediate size of
    each part, zero-padded to the engine's P; None when `name` is no expert weight or nothing fits."""
    source = expert_source(name)
    fused = None if source is None else sent.get(source)
    if fused is None or fused.dim() != 3 or fused.shape[0] != shape[0]:
        return None
    fused = fused.detach()
    if source.endswith("gate_up_proj"):
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


def in_engine_layout(tensor: torch.Tensor, shape: tuple[int, ...], dtype: str, columns=None) -> torch.Tensor | None:
    """`tensor` as the engine stores it: a shorter dim 0 (a padded vocabulary) zero-padded, then (the columns
    `columns` of its last dimension, a slice, if given) cast to its dtype; None when the shapes do not fit."""
    tensor = tensor.detach()
    if tuple(tensor.shape) != shape and tensor.dim() == len(shape) and tuple(tensor.shape[1:]) == shape[1:]:
        if tensor.shape[0] < shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros((shape[0] - tensor.shape[0], *shape[1:]))])
    if tuple(tensor.shape) != shape:
        return None
    return (tensor if columns is None else tensor[..., columns]).to(getattr(torch, dtype))


class SampledSent(Mapping):
    """The sent tensors with only the sampled `columns` of the last dimension of those `width` wide; `whole`
    records whether a tensor of another width was read (the sample then does not commute with the build)."""

    def __init__(self, sent: Mapping[str, torch.Tensor], width: int, columns: slice):
        self.sent, self.width, self.columns, self.whole = sent, width, columns, False

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.sent[name]
        if tensor.dim() < 2 or tensor.shape[-1] != self.width:
            self.whole = True
            return tensor
        return tensor[..., self.columns]

    def __contains__(self, name) -> bool:
        return name in self.sent

    def __iter__(self):
        return iter(self.sent)

    def __len__(self) -> int:
        return len(self.sent)


def build(name, sent, shape, dtype, packed, rank, size, isa, columns=None) -> torch.Tensor | None:
    """`engine_tensor` built one way: from `sent` as given, `columns` taken at the end (after prepacking)."""
    expert = None if name in sent else expert_tensor(name, sent, shape, rank, size)
    rows = shape[0] if shape else None
    source = expert if expert is not None else source_tensor(name, sent, packed, rank, size, rows)
    if source is not None and name in sent:  # a whole sent tensor: the worker's slice of it
        source = shard(source, shape, rank, size)
    if source is None:
        return None
    if expert is not None and isa is not None:  # prepacked whole, then sampled
        tensor = in_engine_layout(source, shape, dtype)
        tensor = None if tensor is None else prepacked(tensor, isa)
        return tensor if tensor is None or columns is None else tensor[..., columns]
    return in_engine_layout(source, shape, dtype, columns)


def engine_tensor(
    name: str, sent: Mapping[str, torch.Tensor], shape: tuple[int, ...], dtype: str, packed: dict[str, list[str]],
    rank: int = 0, size: int = 1, isa: str | None = None, columns: slice | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """Engine weight `name` ([shape] of `dtype`, worker `rank` of `size`) built from the `sent` tensors, only the
    `columns` of its last dimension if given; None when they have no counterpart. The columns are taken from the sent
    tensors first where that commutes with the build: a weight of two or more dimensions whose sources all have its
    last dimension (dim 0 concatenations, shards and paddings leave it alone); otherwise the whole is built first."""
    expert = EXPERT_WEIGHT.match(name) is not None and name not in sent
    early = columns is not None and len(shape) >= 2 and not (expert and (isa is not None or size > 1))
    if early:
        view = SampledSent(sent, shape[-1], columns)
        sampled_shape = (*shape[:-1], len(range(shape[-1])[columns]))
        tensor = build(name, view, sampled_shape, dtype, packed, rank, size, None)
        if tensor is not None and not view.whole:
            return tensor
    return build(name, sent, shape, dtype, packed, rank, size, isa, columns)
