"""Tensor parallelism of the model (`training.parallel.tp`), with sequence parallelism between its layers.

Tensor parallelism (`tensor_parallelize`) follows Megatron's layout with PyTorch's styles, for the decoder
families listed in `TP_FAMILIES` (Qwen2, Qwen3, Llama, Mistral: the same module names):
- the attention's q/k/v and the MLP's gate/up projections column-wise (each rank computes its heads and its
  slice of the intermediate dimension), the o and down projections row-wise, whose partial sums are
  reduce-scattered over the sequence;
- between them the residual stream and the norms are sequence-parallel: each rank holds W / tp positions of
  each row (rows are padded to a multiple of tp x cp: data/packing.py's `width_multiple`) and all-gathers them
  before the attention and the MLP;
- the embedding and the LM head vocabulary-parallel (each rank holds V / tp rows, uneven where tp does not
  divide V: no padding, so nothing changes in the weights); the logprobs of the sampled tokens are computed
  from each rank's slice of the logits with all-reduces of [N] values (the maximum, the sum of exponentials,
  the sampled token's logit, the entropy's sum), never the [N, V] logits (`vocab_parallel_logprobs`,
  Megatron's vocab-parallel cross-entropy). The embedding's output is all-reduced whole, so the model builds
  its masks and rotary embeddings for every position, and the first layer takes its share of the positions.
transformers' own tensor-parallel plans are not used: they do not shard the sequence, and they need the
vocabulary divisible by tp.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TP_FAMILIES = ("qwen2", "qwen3", "llama", "mistral")


def _layer_plan(model_type: str) -> dict:
    gathered = dict(desired_input_layouts=(Replicate(),), use_local_output=True)
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), **gathered),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if model_type == "qwen3":  # per-head norms over [.., heads, head_dim]: this rank's heads, weights shared
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def tensor_parallelize(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Megatron's tensor and sequence parallelism of a causal LM of `TP_FAMILIES` on `tp_mesh`, in place.

    The decoder's output (after its final norm) is gathered whole on every rank, so the heads (the chunked LM
    head, a value or score head) see the same [R, W, H] hidden states as in one process."""
    model_type = model.config.get_text_config().model_type
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, _layer_plan(model_type))
    # The embedding's output is all-reduced whole (not reduce-scattered): the model builds its attention masks and
    # rotary embeddings from it, for all W positions. The first layer takes its rows' share of the positions.
    parallelize_module(
        model.model.layers[0],
        tp_mesh,
        PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
    )
    root_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.norm": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    if model.get_output_embeddings() is not None:
        root_plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())  # the model's own call: one position
    parallelize_module(model, tp_mesh, root_plan)
    if tied:  # each style distributed its own copy of the shared weight: tie them again (both Shard(0))
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


# --- the vocabulary-parallel LM head --------------------------------------------------------------------


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: every rank then computes the same loss from the sum, so the
    gradient of each rank's own term is the sum's gradient itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToRanks(torch.autograd.Function):
    """Identity forward, all-reduce SUM backward: a replicated input each rank uses for its own slice of the
    output, whose gradient is the sum of the slices' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def is_vocab_parallel(weight: torch.Tensor) -> bool:
    """An LM head's weight split over the vocabulary by tensor parallelism (FSDP2 has gathered its own shards)."""
    return (
        isinstance(weight, DTensor)
        and weight.placements[-1] == Shard(0)
        and (weight.device_mesh.mesh_dim_names or ("",))[-1] == "tp"
    )


def vocab_parallel_logprobs(
    weight: DTensor,
    hidden_NH: torch.Tensor,
    targets_NK: torch.Tensor,
    temperature: float,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N, K] of the target ids under softmax(transform(hidden @ W.T) / temperature) and the entropies [N]
    (`transform`: the model's own elementwise soft-cap or scale after its head, training/logit_transform.py), from
    this rank's rows of the vocabulary (`weight`: [V, H] sharded on V, torch.chunk's uneven split): the
    log-sum-exp, the target logits and the entropy's sum are all-reduced over the tensor-parallel ranks as [N]
    or [N, K] values, so the [N, V] logits never exist whole. Equal to the full-vocabulary formula
    (micro_batching.py, `head_chunk`)."""
    mesh = weight.device_mesh
    group = mesh.get_group(mesh.ndim - 1)
    rank, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    local_W = weight.to_local()
    start = rank * math.ceil(weight.shape[0] / size)  # torch.chunk's split: equal chunks, the last smaller
    logits_NV = F.linear(_CopyToRanks.apply(hidden_NH, group), local_W).float()
    logits_NV = (logits_NV if transform is None else transform(logits_NV)) / temperature
    with torch.no_grad():
        max_N = logits_NV.max(dim=-1).values if logits_NV.shape[-1] else logits_NV.new_full(logits_NV.shape[:1], -1e30)
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
    shifted_NV = logits_NV - max_N.unsqueeze(-1)
    sum_exp_N = _SumOverRanks.apply(shifted_NV.exp().sum(dim=-1), group)
    local_ids = targets_NK - start
    here = (local_ids >= 0) & (local_ids < local_W.shape[0])
    picked_NK = shifted_NV.gather(-1, local_ids.clamp(0, max(local_W.shape[0] - 1, 0))) * here
    logprobs_NK = _SumOverRanks.apply(picked_NK, group) - sum_exp_N.log().unsqueeze(-1)
    with torch.no_grad():  # H = log Z - E[logit], both from the all-reduced sums
        expected_N = (shifted_NV.exp() * shifted_NV).sum(dim=-1)
        dist.all_reduce(expected_N, group=group)
        entropy_N = sum_exp_N.log() - expected_N / sum_exp_N
    return logprobs_NK, entropy_N


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over a group's ranks, the gradient of each rank's term the sum's own (see `_SumOverRanks`)."""
    return _SumOverRanks.apply(x, group)
