"""Expert parallelism (`training.parallel.ep`): a mixture-of-experts model's experts split over ranks, each token
sent to its experts' rank and back by all-to-all.

The `ep` ranks are borrowed from FSDP2's shard dimension (`dp_shard x cp`, as torchtitan does): they hold different
tokens (other rows of the batch, or other chunks of a row) and the same dense weights, so splitting the experts
over them adds no rank. The mesh's `dp_shard_cp` dimension is unflattened into (`edp_shard`, `ep`), `ep`
innermost (neighbouring ranks):

- each fused expert weight of transformers' experts modules (`mlp.experts.gate_up_proj` [E, 2I, H],
  `mlp.experts.down_proj` [E, H, I]) becomes a DTensor sharded Shard(0) over `ep` (rank r holds experts
  [r E / ep, (r + 1) E / ep)), and FSDP2 shards it further over `edp_shard` (and replicates it over
  `dp_replicate`) with a `fully_shard` of its own; every other weight is FSDP2-sharded over `dp_shard x cp` as in
  a dense model;
- the experts module's forward (hidden [N, H], top_k_index [N, K], top_k_weights [N, K]) is replaced on the
  instance (`_dispatched_forward`): the (token, slot) pairs sorted by expert, hence by owner rank; the per-expert
  counts exchanged (all_to_all_single); the tokens sent (a differentiable all-to-all with uneven splits); each
  local expert's MLP, down(SiLU(gate) * up), as transformers' eager loop computes it; the outputs sent back,
  weighted by top_k_weights and summed into [N, H].

Gradients: the backward of the all-to-all returns each token's gradient to its rank, and each local expert's
weight gradient is the sum over every `ep` rank's tokens; FSDP2 then SUM-reduces it over `edp_shard` (and
`dp_replicate`), so each expert's gradient is the sum over all ranks' tokens, with the loss divided by the global
batch's normaliser: exactly one process's gradient (FSDP2's division by the shard count is switched off for the
experts' module as for the others, training/fsdp2.py). Full weights (refit, export) and checkpoints gather or
store the experts' DTensors under their global shapes and fused names, so a checkpoint of any `ep` loads under any
other layout. Every local expert runs (an empty batch when no token chose it), so every rank's gradient
reductions see every weight. transformers' own expert-parallel plans are not used: they need its distributed
loading path, not FSDP2.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from reinforge.errors import ConfigError
from reinforge.training.parallel.tensor import copy_to_ranks

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_MESH_DIMS = ("dp_replicate", "edp_shard", "ep", "tp")


def num_experts(text_config) -> int | None:
    """The routed experts per MoE layer of a model's text config (Qwen-MoE's `num_experts`, Mixtral's
    `num_local_experts`); None for a dense model."""
    return getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)


def check_expert_layout(parallel, text_config) -> None:
    """`parallel.ep` splits this model's experts and FSDP2's shard ranks evenly: a one-line error naming the nearest
    valid ep otherwise, or saying that a dense model has no experts to split."""
    if parallel.ep == 1:
        return
    experts = num_experts(text_config)
    if not experts:
        raise ConfigError(
            f"training.parallel.ep={parallel.ep} splits a mixture-of-experts model's experts, and "
            f"{text_config.model_type} is a dense model; set training.parallel.ep=1"
        )
    shard_ranks = parallel.dp_shard * parallel.cp if parallel.dp_shard > 0 else None
    sizes = {"experts": experts} | ({"dp_shard x cp ranks": shard_ranks} if shard_ranks else {})
    bad = [f"{name} ({size})" for name, size in sizes.items() if size % parallel.ep]
    if bad:
        valid = [e for e in range(1, max(sizes.values()) + 1) if all(size % e == 0 for size in sizes.values())]
        nearest = min(valid, key=lambda e: (abs(e - parallel.ep), e))
        raise ConfigError(
            f"training.parallel.ep={parallel.ep} must divide the model's {' and the '.join(bad)} (expert parallelism "
            f"borrows FSDP2's shard ranks); the nearest valid ep is {nearest}"
        )


def expert_mesh(mesh: DeviceMesh, parallel) -> DeviceMesh:
    """The training mesh with `dp_shard_cp` unflattened into (`edp_shard`, `ep`): EXPERT_MESH_DIMS."""
    shard_ranks = parallel.dp_shard * parallel.cp
    return mesh["dp_replicate", "dp_shard_cp", "tp"]._unflatten(
        "dp_shard_cp", (shard_ranks // parallel.ep, parallel.ep), ("edp_shard", "ep")
    )


def expert_fsdp_mesh(mesh: DeviceMesh, parallel) -> DeviceMesh:
    """FSDP2's mesh for the experts' weights: `edp_shard`, with HSDP's replicate dimension when there are copies."""
    return mesh["dp_replicate", "edp_shard"] if parallel.dp_replicate > 1 else mesh["edp_shard"]


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts modules: transformers' fused [E, ., .] gate_up_proj and down_proj weights."""
    return [
        module
        for module in model.modules()
        if all(isinstance(getattr(module, name, None), torch.nn.Parameter) for name in EXPERT_WEIGHTS)
        and module.gate_up_proj.dim() == 3
    ]


def shard_experts(model: torch.nn.Module, ep_mesh: DeviceMesh) -> list[torch.nn.Module]:
    """Each experts module's weights sharded Shard(0) over `ep_mesh`'s `ep` dimension (every rank keeps its own
    slice of the weights it loaded, the same on every rank: no communication) and its forward replaced by the
    dispatching one; the modules, for FSDP2 to shard on their own mesh. With tensor parallelism `ep_mesh` is the
    (ep, tp) mesh and the weights are tensor-parallel already (parallel/tensor_plan.py): each keeps its tp
    placement, the ep split on the experts' dimension beside it."""
    modules = expert_modules(model)
    rank, size = ep_mesh.get_local_rank("ep"), ep_mesh.size(ep_mesh.mesh_dim_names.index("ep"))
    for module in modules:
        if module.is_transposed or module.has_bias or not module.has_gate or not module.is_concatenated:
            raise ConfigError(
                f"training.parallel.ep supports fused [gate; up] experts without biases (Qwen-MoE's layout), not "
                f"{type(module).__name__}'s; set training.parallel.ep=1"
            )
        for name in EXPERT_WEIGHTS:
            weight = getattr(module, name)
            tp_placements = list(weight.placements) if isinstance(weight, DTensor) else []
            whole = weight.to_local() if isinstance(weight, DTensor) else weight
            local = whole.detach().chunk(size, dim=0)[rank].clone()
            sharded = DTensor.from_local(
                local, ep_mesh, [Shard(0), *tp_placements], run_check=False, shape=weight.shape, stride=weight.stride()
            )
            setattr(module, name, torch.nn.Parameter(sharded, requires_grad=weight.requires_grad))
        module.ep_group = ep_mesh.get_group("ep")
        module.forward = types.MethodType(_dispatched_forward, module)
    return modules


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent in `send_sizes` pieces to the group's ranks, `receive_sizes` rows received from each; the
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = (receive_sizes, send_sizes), group
        return _all_to_all(x, receive_sizes, send_sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        receive_sizes, send_sizes = ctx.sizes
        return _all_to_all(grad, send_sizes, receive_sizes, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(receive_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive_sizes, send_sizes, group=group)
    return out


def _dispatched_forward(
    self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor, top_k_weights_NK: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward with the experts on `ep` ranks (the module docstring). S = N x K (token, slot)
    pairs; this rank holds L = E / ep experts and receives M pairs."""
    group, num_ranks = self.ep_group, dist.get_world_size(self.ep_group)
    num_local = self.num_experts // num_ranks
    expert_S = top_k_index_NK.reshape(-1)
    with torch.no_grad():
        order_S = torch.argsort(expert_S, stable=True)  # by expert, so by owner rank
        counts_E = torch.bincount(expert_S, minlength=self.num_experts + 1)[: self.num_experts]
        order_S = order_S[: int(counts_E.sum())]  # an index past the experts (a dropped slot) goes nowhere
        received = torch.empty_like(counts_E)  # [source rank, local expert]: the pairs each rank sends here
        dist.all_to_all_single(received, counts_E, group=group)
        received_RL = received.view(num_ranks, num_local)
        send_sizes = counts_E.view(num_ranks, num_local).sum(dim=1).tolist()
        receive_sizes = received_RL.sum(dim=1).tolist()
        # the received rows are by source rank, then expert: regroup them by expert
        local_expert_M = torch.arange(num_local, device=received.device).repeat(num_ranks)
        by_expert_M = torch.argsort(local_expert_M.repeat_interleave(received_RL.reshape(-1)), stable=True)
    token_S = order_S // top_k_index_NK.shape[1]
    routed_MH = _AllToAll.apply(hidden_NH[token_S], receive_sizes, send_sizes, group)[by_expert_M]
    outputs = expert_mlps(self, list(routed_MH.split(received_RL.sum(dim=0).tolist())))
    computed_MH = torch.empty_like(routed_MH).index_copy(0, by_expert_M, torch.cat(outputs))  # back by source
    returned_SH = _AllToAll.apply(computed_MH, send_sizes, receive_sizes, group)
    weighted_SH = returned_SH * top_k_weights_NK.reshape(-1)[order_S, None]
    return torch.zeros_like(hidden_NH).index_add(0, token_S, weighted_SH.to(hidden_NH.dtype))


def expert_layout(experts: torch.nn.Module) -> tuple[bool, bool, bool]:
    """(transposed, concatenated, has_bias) of transformers' fused experts; a one-line error for a layout without a
    gate (up_proj only)."""
    if not getattr(experts, "has_gate", True):
        raise ConfigError(
            f"tensor and expert parallelism support gated experts (gate_up_proj), not {type(experts).__name__}'s; "
            f"set training.parallel.tp=1 and ep=1"
        )
    return (
        getattr(experts, "is_transposed", False),
        getattr(experts, "is_concatenated", True),
        getattr(experts, "has_bias", False),
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def expert_mlps(experts: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each local expert's MLP on its tokens (`inputs[e]` [T_e, H]), as transformers' eager loop computes it.

    Under tensor parallelism (`experts.tp_group`, parallel/tensor_plan.py) each rank holds contiguous blocks of
    the [gate; up] and intermediate dimensions: the gate_up outputs of every expert are all-gathered in one
    collective (a concatenated layout: a block is part of the gate or of the up half), the activation taken on
    this rank's units, and the outputs are partial sums (all-reduced by the caller's hook); the down
    projection's bias joins on tp rank 0, its gradient summed over the ranks."""
    transposed, concatenated, has_bias = expert_layout(experts)
    gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
    group = getattr(experts, "tp_group", None)
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    hiddens = []
    for expert, x_TH in enumerate(inputs):
        h = x_TH @ gate_up[expert] if transposed else F.linear(x_TH, gate_up[expert])
        hiddens.append(h + _local(experts.gate_up_proj_bias)[expert] if has_bias else h)
    gathered = size > 1 and concatenated
    if gathered:
        hiddens = _GatherColumns.apply(torch.cat(hiddens), group).split([len(x) for x in inputs])
    outputs = []
    for expert, h in enumerate(hiddens):
        if hasattr(experts, "_apply_gate"):
            a = experts._apply_gate(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            a = experts.act_fn(gate) * up
        a = a.chunk(size, dim=-1)[rank] if gathered else a
        y = a @ down[expert] if transposed else F.linear(a, down[expert])
        if has_bias:
            bias = experts.down_proj_bias if group is None else copy_to_ranks(experts.down_proj_bias, group)
            y = y + bias[expert] * (rank == 0)
        outputs.append(y)
    return outputs


class _GatherColumns(torch.autograd.Function):
    """The ranks' [S, C] blocks side by side, [S, C x ranks]; the backward sums the gradients over the ranks and
    returns this rank's block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        blocks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(blocks, x.contiguous(), group=group)
        return torch.cat(blocks, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[dist.get_rank(ctx.group)], None
