"""Attention over segments: each query range attends to a key prefix and to itself, nothing else.

Shared-prompt rows (data/packing.py, `shared_prompt_layout`) hold a prompt once and then each of its
samples' answers; an answer attends to the prompt and to itself. Written as one [W, W] mask over the
row, attention would cost the square of the row's width, mostly on pairs the mask removes (about 7x
the useful pairs for 8 samples of a 36-token prompt with 48-token answers). Here each segment (a
prompt, or an answer with its prompt as prefix) is gathered on its own: queries [N, Q], keys [N, K]
with K = prefix + own length, and one `scaled_dot_product_attention` per bucket of segments of similar
length. The cost is what the sequences would cost unshared, minus the prompt's repeats.

It plugs into transformers' attention interface under `SEGMENT_ATTENTION`: `run_layout` switches the
model's attention implementation to it for the forward pass of a shared-prompt layout and passes the
segments as the `attention_segments` keyword, which transformers hands down to every attention layer.
That name has no mask function registered, so transformers builds no [W, W] mask for it either.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from reinforge.data.packing import SegmentBucket

SEGMENT_ATTENTION = "reinforge_segments"


@torch.compiler.disable  # a Python loop over buckets of varying count and shape: a graph break, not recompiles
def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      attention_segments: list[SegmentBucket] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [R, Hq, W, D], key and value [R, Hkv, W, D];
    returns [R, W, Hq, D]. Positions in no segment (a row's padding) get zeros."""
    assert attention_segments is not None, "segment attention needs the layout's attention_segments"
    assert dropout == 0.0, "segment attention has no dropout"
    rows, heads, width, head_dim = query.shape
    repeats = heads // key.shape[1]  # grouped-query attention: each key/value head serves `repeats` query heads
    query_flat = query.transpose(1, 2).reshape(rows * width, heads, head_dim)
    key_flat = key.transpose(1, 2).reshape(rows * width, key.shape[1], head_dim)
    value_flat = value.transpose(1, 2).reshape(rows * width, key.shape[1], head_dim)
    positions, outputs = [], []
    for bucket in attention_segments:
        q = query_flat[bucket.query_index].transpose(1, 2)  # [N, Hq, Q, D]
        k = key_flat[bucket.key_index].transpose(1, 2)  # [N, Hkv, K, D]
        v = value_flat[bucket.key_index].transpose(1, 2)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=scaling).transpose(1, 2)  # [N, Q, Hq, D]
        positions.append(bucket.query_index[bucket.query_valid])
        outputs.append(attended[bucket.query_valid])
    output = query_flat.new_zeros(query_flat.shape).index_copy(0, torch.cat(positions), torch.cat(outputs))
    return output.view(rows, width, heads, head_dim), None


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)


@contextmanager
def using_segment_attention(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """The model's attention layers run `segment_attention` inside the block (if `enabled`), their own
    implementation after. A backward pass that recomputes layers (activation checkpointing) must run
    inside it too."""
    config = model.config
    saved = config._attn_implementation
    if enabled:
        config._attn_implementation = SEGMENT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = saved
