"""Tensor parallelism of the model (`training.parallel.tp`), with sequence parallelism between its layers.

Tensor parallelism (`tensor_parallelize`, parallel/tensor_plan.py: the plan read from each layer's modules, for
every family it can split exactly) follows Megatron's layout with PyTorch's styles:
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
from torch.distributed.tensor import DTensor, Shard

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


def copy_to_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """`x` as it is, its gradient summed over a group's ranks (see `_CopyToRanks`): a replicated input of partial
    computations."""
    return _CopyToRanks.apply(x, group)
