"""Attention over segments, and the one place that picks a forward pass's attention: its layout.

A packed layout (data/packing.py, `row_layout`) holds sequences end to end in rows, a shared prompt
once before its samples' answers; each token attends to its own sequence only. Written as one [W, W]
mask over the row, attention would cost the square of the row's width, mostly on pairs the mask removes
(about 7x the useful pairs for 8 samples of a 36-token prompt with 48-token answers). Here each segment
(a whole sequence, or an answer with its prompt as prefix) is gathered on its own: queries [N, Q], keys
[N, K] with K = prefix + own length, and one `scaled_dot_product_attention` per bucket of segments of
similar length. The cost is what the sequences would cost one per row unpadded, minus the prompt's repeats.

`forward_layout` runs the model on a layout: a packed one through `segment_attention` (registered with
transformers' attention interface under `SEGMENT_ATTENTION`, the segments passed as the
`attention_segments` keyword, which transformers hands down to every attention layer; that name has no
mask function registered, so transformers builds no [W, W] mask for it either), a padded one through
the model's own implementation and attention mask. Activation checkpointing's recompute, which runs
later in the backward pass, replays the implementation its forward ran with (modeling.py,
`enable_activation_checkpointing`), so the two cannot disagree and no caller switches anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from reinforge.data.packing import RowLayout, SegmentBucket
from reinforge.modeling import attention_implementation

SEGMENT_ATTENTION = "reinforge_segments"


@torch.compiler.disable  # a Python loop over buckets of varying count and shape: a graph break, not recompiles
def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attention_segments: list[SegmentBucket] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [R, Hq, W, D], key and value [R, Hkv, W, D];
    returns [R, W, Hq, D]. Positions in no segment (a row's padding) get zeros."""
    assert attention_segments is not None, "segment attention needs the layout's attention_segments (forward_layout)"
    assert dropout == 0.0, "segment attention has no dropout"
    rows, heads, width, head_dim = query.shape
    repeats = heads // key.shape[1]  # grouped-query attention: each key/value head serves `repeats` query heads
    query_flat = query.transpose(1, 2).reshape(rows * width, heads, head_dim)
    key_flat = key.transpose(1, 2).reshape(rows * width, key.shape[1], head_dim)
    value_flat = value.transpose(1, 2).reshape(rows * width, key.shape[1], head_dim)
    positions, outputs = [], []
    for bucket in attention_segments:
        assert bucket.mask is not None, "the layout's masks are built by RowLayout.to"
        q = query_flat[bucket.query_index].transpose(1, 2)  # [N, Hq, Q, D]
        k = key_flat[bucket.key_index].transpose(1, 2)  # [N, Hkv, K, D]
        v = value_flat[bucket.key_index].transpose(1, 2)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=scaling).transpose(
            1, 2
        )  # [N, Q, Hq, D]
        positions.append(bucket.query_index[bucket.query_valid])
        outputs.append(attended[bucket.query_valid])
    output = query_flat.new_zeros(query_flat.shape).index_copy(0, torch.cat(positions), torch.cat(outputs))
    return output.view(rows, width, heads, head_dim), None


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)


def forward_layout(model: torch.nn.Module, layout: RowLayout, **kwargs):
    """`model`'s output for a layout already on the model's device (`RowLayout.to`); keyword arguments
    go to the model (`logits_to_keep`)."""
    if layout.segments is None:
        return model(
            input_ids=layout.input_ids,
            position_ids=layout.position_ids,
            attention_mask=layout.attention_mask,
            use_cache=False,
            **kwargs,
        )
    with attention_implementation(model.config, SEGMENT_ATTENTION):
        return model(
            input_ids=layout.input_ids,
            position_ids=layout.position_ids,
            attention_mask=None,
            use_cache=False,
            attention_segments=layout.segments,
            **kwargs,
        )
