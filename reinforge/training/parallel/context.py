"""Ulysses sequence parallelism: a row longer than one rank holds, split over the ranks of a `cp` group.

Each of the cp ranks holds a contiguous chunk of every row's columns (W rounded up to a multiple of cp;
the added columns are in no segment and masked, so every real token's result is exact) and runs the
whole model on it: embeddings, norms, MLPs and projections see W/cp positions. Rotary embeddings come
from the chunk's own `position_ids`, so each position gets its own angle. Only attention needs the whole
row: around it, one all-to-all turns q, k and v from [R, H, W/cp, D] (this rank's positions, all heads)
into [R, H/cp, W, D] (all positions, this rank's heads), segment attention (training/segment_attention.py)
runs on the whole row for those heads, with the whole layout's segments (a padded layout's rows are one
segment each), so each layer's own variants (its sliding window, soft-cap, sinks: this rank's heads'
ones) are honoured as in one process, and a second all-to-all brings the output back to [R, W/cp, H, D].
Both all-to-alls are differentiable (the backward of one is the other), and they work on gloo. Reference: Jacobs et al.,
"DeepSpeed Ulysses" (2023); as there, the query heads (and the key/value heads, repeated when fewer
than cp) must split evenly over the group.

`ulysses_forward` mirrors segment_attention.py's `forward_layout`: same layout, same keyword arguments,
the model's output for this rank's chunk of columns (`sequence_chunk`). The group and the whole row's
segments travel as keyword arguments, which transformers hands down to every
attention layer, so activation checkpointing's recompute (which replays the layer's call) sees them.
The per-rank outputs then meet in one of two ways (each rank's parameter gradients are then its chunk's
share, and the group's sum is one process's gradient):
- `gather_sequence`: every rank holds the whole [R, W, H] and computes the same loss; the gradient of its
  chunk is its columns of the gathered gradient. Modules applied after the gather (an LM head) then run
  identically on every rank: their gradients are cp times too large once summed over the group.
- `sum_over_group`: each rank computes its own tokens' outputs (zero elsewhere, `sequence_chunk` says
  which columns are its own) and the sum gives every rank all of them. Nothing is computed twice.

PyTorch's `torch.distributed.tensor.experimental.context_parallel` (ring attention) is the GPU path, not
used or tested here: on CPU it has no sharding strategy for the CPU flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`), torch 2.13.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig

from reinforge.data.packing import RowLayout, SegmentBucket, segment_buckets
from reinforge.errors import ConfigError
from reinforge.modeling import attention_implementation
from reinforge.training.parallel.tensor import sum_over_ranks
from reinforge.training.segment_attention import segment_attention

ULYSSES_ATTENTION = "reinforge_ulysses"


# --- Differentiable collectives ---------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """`x` cut into cp pieces along `scatter_dim`, piece j sent to rank j, the pieces received joined along
    `gather_dim` in rank order. Its backward is the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    assert x.shape[scatter_dim] % size == 0, f"dimension {scatter_dim} of {tuple(x.shape)} does not split {size} ways"
    sent = torch.stack(x.chunk(size, dim=scatter_dim))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[R, H, W/cp, D] (this rank's chunk of positions, all heads) -> [R, H/cp, W, D] (all positions, this
    rank's group of heads: group rank g holds heads g*H/cp ...)."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [R, H/cp, W, D] -> [R, H, W/cp, D]."""
    return _AllToAll.apply(x, group, 2, 1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[1]
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = dist.get_rank(ctx.group) * ctx.width
        return grad[:, start : start + ctx.width], None


def gather_sequence(x_local: torch.Tensor, group: dist.ProcessGroup, width: int | None = None) -> torch.Tensor:
    """This rank's chunk [R, W/cp, ...] of every row -> the whole rows [R, W, ...] on every rank, cut to the
    layout's `width` (dropping the columns added to make W split). Backward: every rank computes the same
    loss from the whole rows, so its own derivative of that loss at its chunk is its columns of the
    gradient, taken as they are (summing over ranks would count the loss cp times)."""
    gathered = _GatherSequence.apply(x_local, group)
    return gathered if width is None else gathered[:, :width]


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `x` over the group's ranks, on every rank. Backward: identity, for per-token outputs that
    each rank computes on its own tokens (zero elsewhere): every rank then computes the same loss from the
    sum, and the gradient at its own tokens is the loss's, which reaches only its own computation."""
    return sum_over_ranks(x, group)


# --- Which models run context-parallel --------------------------------------------------------

_GROUPS: "weakref.WeakKeyDictionary[torch.nn.Module, dist.ProcessGroup]" = weakref.WeakKeyDictionary()


def split_context(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Run `model`'s forward passes on layouts split over `group` (the strategy's cp ranks; `context_group`)."""
    _GROUPS[model] = group


def context_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The cp group `model` splits its layouts over (`split_context`), or None: the whole rows on this rank."""
    return _GROUPS.get(model)


# --- Which columns a rank holds ---------------------------------------------------------------


@dataclass(frozen=True)
class SequenceChunk:
    """This rank's columns [start, end) of rows `width` wide, padded to `padded_width` (a multiple of cp)."""

    width: int
    padded_width: int
    start: int
    end: int


def sequence_chunk(width: int, group: dist.ProcessGroup) -> SequenceChunk:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-width // size)
    return SequenceChunk(width, chunk * size, rank * chunk, (rank + 1) * chunk)


def check_heads(config: PretrainedConfig, cp: int) -> None:
    """Ulysses splits the attention heads over the cp ranks: the query heads must divide evenly, and the
    key/value heads must divide by cp or cp by them (then each is repeated to cp heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % cp or (kv_heads % cp and cp % kv_heads):
        raise ConfigError(
            f"training.parallel.cp={cp} must divide the model's {heads} attention heads and divide or be divided by "
            f"its {kv_heads} key/value heads (Ulysses splits heads over the cp ranks); choose a cp that does"
        )


# --- The attention function -------------------------------------------------------------------


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ulysses_group: dist.ProcessGroup | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [R, Hq, W/cp, D], key and value [R, Hkv, W/cp, D]
    (this rank's positions); `attention_segments` (in kwargs) the whole layout's. Returns [R, W/cp, Hq, Dv], as
    segment attention (training/segment_attention.py) would for the whole rows: `scaling`, `sliding_window`,
    `softcap` and the rest of `kwargs` go to it, and the per-head sinks `s_aux` (gpt-oss) as this rank's heads'."""
    assert ulysses_group is not None, "Ulysses attention runs under ulysses_forward"
    size, rank = dist.get_world_size(ulysses_group), dist.get_rank(ulysses_group)
    if key.shape[1] % size:  # fewer key/value heads than ranks: each rank gets a copy of its query heads' one
        key = key.repeat_interleave(size // key.shape[1], dim=1)
        value = value.repeat_interleave(size // value.shape[1], dim=1)
    query, key, value = (seq_to_heads(t, ulysses_group) for t in (query, key, value))
    if s_aux is not None:  # rank g holds query heads g * Hq/cp ... (`seq_to_heads`)
        kwargs["s_aux"] = s_aux.chunk(size)[rank]
    output, _ = segment_attention(module, query, key, value, None, **kwargs)  # [R, W, Hq/cp, Dv]
    return _AllToAll.apply(output, ulysses_group, 1, 2), None


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)


# --- The forward pass -------------------------------------------------------------------------


def _padded_segments(segments: list[SegmentBucket], width: int, padded_width: int) -> list[SegmentBucket]:
    """The segments' flat indices in rows `padded_width` wide instead of `width` (masks unchanged)."""
    if padded_width == width:
        return segments
    return [
        replace(
            bucket,
            query_index=bucket.query_index // width * padded_width + bucket.query_index % width,
            key_index=bucket.key_index // width * padded_width + bucket.key_index % width,
        )
        for bucket in segments
    ]


def padded_segments(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> list[SegmentBucket]:
    """A padded layout's rows [R, W] (right-padded sequences) as segments, one per row, their masks built from
    `position_ids` [R, W + added columns]: causal within each sequence, windows by its positions."""
    width = attention_mask.shape[1]
    lengths = attention_mask.sum(dim=1).tolist()
    buckets = segment_buckets([(r * width, r * width + n, r * width, r * width) for r, n in enumerate(lengths)])
    flat_positions = position_ids[:, :width].flatten()
    return [bucket.to(attention_mask.device).with_mask(flat_positions) for bucket in buckets]


def ulysses_forward(
    model: torch.nn.Module, layout: RowLayout, group: dist.ProcessGroup, images: dict | None = None, **kwargs
):
    """`model`'s output for this rank's chunk of columns (`sequence_chunk(W, group)`) of a layout already on
    the model's device (`RowLayout.to`), every rank of `group` calling it with the same layout; keyword
    arguments go to the model. The decoder's hidden states are [R, padded W / cp, H].

    `images` (a vision-language model's image tensors for the layout, data/images.py's `forward_images`): the
    model embeds the whole rows and merges every image's features into them, and its decoder takes this rank's
    chunk of the embeddings (`_decoder_takes_chunk`). Each rank runs the vision tower on all of the layout's
    images; the gradient reaching it is its own chunk's share, and the group's sum is one process's."""
    check_heads(model.config.get_text_config(), dist.get_world_size(group))
    chunk = sequence_chunk(layout.input_ids.shape[1], group)
    pad = chunk.padded_width - chunk.width
    input_ids = F.pad(layout.input_ids, (0, pad))
    added = layout.position_ids[:, -1:] + 1 + torch.arange(pad, device=input_ids.device)  # attended by no token
    position_ids = torch.cat([layout.position_ids, added], dim=1)
    segments = layout.segments
    if segments is None:  # padded: each row one segment, its sequence
        segments = padded_segments(layout.attention_mask, position_ids)
    segments = _padded_segments(segments, chunk.width, chunk.padded_width)
    columns = slice(chunk.start, chunk.end)
    hook = None
    if images:  # whole rows in, the decoder cuts them
        hook = model.get_decoder().register_forward_pre_hook(_decoder_takes_chunk(columns), with_kwargs=True)
        kwargs |= images
    else:
        input_ids, position_ids = input_ids[:, columns], position_ids[:, columns]
    try:
        with attention_implementation(model.config, ULYSSES_ATTENTION):
            return model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=None,
                use_cache=False,
                attention_segments=segments,
                ulysses_group=group,
                **kwargs,
            )
    finally:
        if hook is not None:
            hook.remove()


def _decoder_takes_chunk(columns: slice):
    """A forward pre-hook on a vision-language model's decoder: its whole-row `inputs_embeds` [R, W, H] (image
    features merged) and `position_ids` [..., R, W] cut to this rank's columns."""

    def hook(module, args, kwargs):
        assert not args and kwargs.get("inputs_embeds") is not None, "the decoder is called with inputs_embeds"
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"][:, columns]
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"][..., columns]
        return args, kwargs

    return hook
