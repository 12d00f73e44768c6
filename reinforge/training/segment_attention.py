"""Attention over segments, and the one place that picks a forward pass's attention: its layout.

A packed layout (data/packing.py, `row_layout`) holds sequences end to end in rows, a shared prompt
once before its samples' answers; each token attends to its own sequence only. Written as one [W, W]
mask over the row, attention would cost the square of the row's width, mostly on pairs the mask removes
(about 7x the useful pairs for 8 samples of a 36-token prompt with 48-token answers). Here each segment
(a whole sequence, or an answer with its prompt as prefix) is gathered on its own: queries [N, Q], keys
[N, K] with K = prefix + own length, and one `scaled_dot_product_attention` per bucket of segments of
similar length. The cost is what the sequences would cost one per row unpadded, minus the prompt's repeats.
Each layer's attention is the model's own: the window, scaling, soft-cap and sinks its attention layer passes
(`segment_attention`), so every layout gives a plain transformers forward's logprobs (docs/architecture.md).

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
from reinforge.errors import ConfigError
from reinforge.modeling import attention_implementation, say_once

SEGMENT_ATTENTION = "reinforge_segments"
# attention-function arguments of transformers' layers that change what attention computes and that segment
# attention does not do (a relative position bias, sparse attention's selected keys): a one-line error, not ignored
UNKNOWN_VARIANTS = ("position_bias", "indices", "block_indices")


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [R, Hq, W, D], key [R, Hkv, W, D], value [R, Hkv, W, Dv]
    (Dv != D: DeepSeek's MLA); returns [R, W, Hq, Dv]. Positions in no segment (a row's padding) get zeros.
    The layer's own variants, as its attention layer passes them: `scaling` (query_pre_attn_scalar, Granite's
    attention_multiplier), `sliding_window` (by the tokens' positions, `SegmentBucket.window_mask`), `softcap`
    (Gemma 2's attn_logit_softcapping) and `s_aux` (gpt-oss' per-head sinks); the last two through `exact_attention`."""
    assert attention_segments is not None, "segment attention needs the layout's attention_segments (forward_layout)"
    assert dropout == 0.0, "segment attention has no dropout"
    unknown = [name for name in UNKNOWN_VARIANTS if kwargs.get(name) is not None]
    if kwargs.get("is_causal") is False or unknown:
        raise ConfigError(
            f"{type(module).__name__} asks its attention for {', '.join(unknown) or 'is_causal=False'}, which the "
            "packed layouts do not do; set training.sequence_packing=false (and training.parallel.cp=1)"
        )
    rows, heads, width, head_dim = query.shape
    kv_heads, value_dim = key.shape[1], value.shape[-1]
    repeats = heads // kv_heads  # grouped-query attention: each key/value head serves `repeats` query heads
    exact = softcap is not None or s_aux is not None
    scaling = scaling if scaling is not None else head_dim**-0.5  # sdpa's default and transformers' eager
    if exact:
        say_once(f"{type(module).__name__}: attention with soft-capping or sinks, which sdpa cannot do, runs eager")
    query_flat = query.transpose(1, 2).reshape(rows * width, heads, head_dim)
    key_flat = key.transpose(1, 2).reshape(rows * width, kv_heads, head_dim)
    value_flat = value.transpose(1, 2).reshape(rows * width, kv_heads, value_dim)
    positions, outputs = [], []
    for bucket in attention_segments:
        assert bucket.mask is not None, "the layout's masks are built by RowLayout.to"
        mask = bucket.mask if sliding_window is None else bucket.window_mask(sliding_window)
        q = query_flat[bucket.query_index].transpose(1, 2)  # [N, Hq, Q, D]
        k = key_flat[bucket.key_index].transpose(1, 2)  # [N, Hkv, K, D]
        v = value_flat[bucket.key_index].transpose(1, 2)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        if exact:
            attended = exact_attention(q, k, v, mask, scaling, softcap, s_aux)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        positions.append(bucket.query_index[bucket.query_valid])
        outputs.append(attended.transpose(1, 2)[bucket.query_valid])  # [N, Q, Hq, Dv] at the valid queries
    output = query_flat.new_zeros(rows * width, heads, value_dim)
    output = output.index_copy(0, torch.cat(positions), torch.cat(outputs))
    return output.view(rows, width, heads, value_dim), None


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """[N, H, Q, Dv]: attention as transformers' eager functions compute it (gemma2's and gpt_oss'
    `eager_attention_forward`): scores scaled, soft-capped (tanh(s / cap) * cap), masked with the dtype's minimum;
    with sinks, one more logit per head joins each row's softmax and is dropped after it."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(weights, v)


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
