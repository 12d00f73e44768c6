"""The tensor-parallel plan of a decoder (`training.parallel.tp`), derived from each layer's own modules.

transformers' `base_model_tp_plan` (colwise q/k/v and gate/up, rowwise o and down, `packed_colwise` for fused
[gate; up] weights, `colwise_gather_output` where a module needs the whole projection, `moe_tp_experts`) is the
starting point; it does not shard the sequence, leaves the MoE router's and sandwich norms' gradients to its own
loader, and gives no plan for gpt-oss or DeepSeek-V3's attention. Here each decoder layer is read and planned,
with sequence parallelism between the blocks (the residual stream holds W / tp positions per rank):

- norms that are children of the layer (input, post-attention, Gemma's pre/post-feedforward, OLMo 2's post
  norms) are sequence-parallel: each rank normalises its positions, the weights' gradients summed over ranks;
- attention with only q/k/v/o projections (and per-head q/k norms over head_dim: Qwen3, Gemma 3) is split by
  heads: q/k/v column-wise, o row-wise with its partial sums reduce-scattered over the sequence. With fewer
  key/value heads than ranks (GQA's kv=1) k/v are gathered whole and each rank keeps its query heads' kv head;
- any other attention (OLMo 2's and OLMoE's q/k norms over all heads, Phi-3's fused qkv_proj, gpt-oss's
  per-head sinks, DeepSeek-V3's MLA) is "gathered": every projection's weight split column-wise and its output
  all-gathered, the attention itself computed whole on every rank (its norms and sinks replicated, their
  gradients equal on every rank), o_proj row-wise on this rank's columns. Exact for any attention; the
  projections' memory and FLOPs are split, the attention core is not;
- the dense MLP: gate/up column-wise, down row-wise (reduce-scattered); a fused gate_up_proj (Phi-3) column-wise
  with its output gathered, down row-wise on this rank's columns (transformers' plan for Phi-3);
- a mixture-of-experts block runs on the gathered sequence: the router replicated; the experts' weights split
  in contiguous blocks (gate_up_proj [E, 2I, H] on 2I, its outputs all-gathered per layer so each rank applies
  the activation to its own units of the intermediate dimension; down_proj [E, H, I] on I; gpt-oss's
  interleaved, transposed layout, whose blocks hold whole gate/up pairs, and its biases without a gather), the
  partial outputs all-reduced before the block's output is cut back to this rank's positions; shared experts
  column/row-wise with the output all-reduced. With expert parallelism the same split holds on each `ep` rank's
  experts (parallel/expert.py).

Every weight stays a parameter under one process's name, a DTensor whose full value (`full_tensor()`, what
state dicts, checkpoints and the refit gather) is one process's weight. A family whose layers cannot be split
exactly is refused at config time (`check_tensor_parallel`).
"""

from __future__ import annotations

import types

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from reinforge.errors import ConfigError
from reinforge.training.parallel.expert import expert_layout, expert_mlps
from reinforge.training.parallel.lora_tensor import adapter_styles, is_adapted
from reinforge.training.parallel.model_shape import TP_REFUSED
from reinforge.training.parallel.tensor import copy_to_ranks, sum_over_ranks

# families transformers gives no `base_model_tp_plan` that the layer reading below splits exactly
OWN_PLANS = ("gpt_oss",)
ATTENTION_NAMES = ("self_attn", "attention", "attn")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
HEAD_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj"}
GATHERED = dict(desired_input_layouts=(Replicate(),), use_local_output=True)


def check_tensor_parallel(tp: int, text_config) -> None:
    """`tp` splits this model exactly: a one-line error naming the family and the reason, or the nearest valid tp."""
    family = text_config.model_type
    if family in TP_REFUSED:
        raise ConfigError(
            f"tensor parallelism (training.parallel.tp={tp}) does not support {family}: {TP_REFUSED[family]}; "
            f"set training.parallel.tp=1 (FSDP2 shards it over the ranks)"
        )
    if not getattr(text_config, "base_model_tp_plan", None) and family not in OWN_PLANS:
        raise ConfigError(
            f"tensor parallelism (training.parallel.tp={tp}) splits the families transformers gives a "
            f"tensor-parallel plan (and {', '.join(OWN_PLANS)}), and {family} has none; set training.parallel.tp=1"
        )
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    sizes = {"attention heads": heads}
    if kv_heads >= tp or tp % kv_heads:  # fewer kv heads than ranks: each rank keeps its queries' kv head
        sizes["key/value heads"] = kv_heads
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(getattr(text_config, name, None), int) and getattr(text_config, name) > 0:
            sizes[f"{name} (MLP columns)"] = getattr(text_config, name)
    bad = [f"{name} ({size})" for name, size in sizes.items() if size % tp]
    if bad:
        valid = [t for t in range(1, tp * 2 + 1) if all(size % t == 0 for size in sizes.values())]
        nearest = min(valid, key=lambda t: (abs(t - tp), t))
        raise ConfigError(
            f"training.parallel.tp={tp} does not divide the model's {', '.join(bad)}; the nearest valid tp is {nearest}"
        )


def tensor_parallelize(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Tensor and sequence parallelism of a causal LM, or of a vision-language model's language model, on
    `tp_mesh`, in place (the module docstring).

    The decoder is `model.get_decoder()` (a vision-language model's text model): its layers, embedding and final
    norm are split; a vision tower and its projector are left whole on every rank (FSDP2 shards them over the
    data-parallel ranks only). Their image features are merged into the all-reduced embeddings before the first
    layer takes its share of the positions, and that layer's backward all-gathers the positions' gradients, so
    every rank's vision tower gets the whole gradient, as in one process.
    The decoder's output (after its final norm) is gathered whole on every rank, so the heads (the chunked LM
    head, a value or score head) see the same [R, W, H] hidden states as in one process."""
    family = model.config.get_text_config().model_type
    decoder = model.get_decoder()
    if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise ConfigError(f"tensor parallelism does not find {family}'s decoder layers; set training.parallel.tp=1")
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}  # LoRA's base
    for layer in decoder.layers:
        after: list = []  # hooks that act on a style's outputs: registered after the styles' own
        plan = adapter_styles(layer, layer_plan(layer, family, tp_mesh, after), tp_mesh.size())
        parallelize_module(layer, tp_mesh, plan)
        for hook in after:
            hook()
    # The embedding's output is all-reduced whole (not reduce-scattered): the model builds its attention masks and
    # rotary embeddings from it, for all W positions (and merges image features into it). The first layer takes
    # its rows' share of the positions.
    parallelize_module(
        decoder.layers[0],
        tp_mesh,
        PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
    )
    decoder_plan = {"norm": PrepareModuleInput(input_layouts=(Shard(1),), **GATHERED)}
    embedding, output = decoder.embed_tokens, model.get_output_embeddings()
    head = getattr(output, "weight", None)
    tied = head is not None and embedding is not None and head is embedding.weight  # before the styles replace them
    if embedding is not None:  # a pipeline stage may hold neither (parallel/pipeline.py)
        decoder_plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    parallelize_module(decoder, tp_mesh, decoder_plan)
    if head is not None:  # the model's own call: one position
        parallelize_module(output, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        if tied:  # each style distributed its own copy of the shared weight: tie them again (both Shard(0))
            output.weight = decoder.embed_tokens.weight
    for name, param in model.named_parameters():  # SequenceParallel's replicas require grad: a frozen norm stays so
        param.requires_grad_(name not in frozen)
    return model


def layer_plan(layer: torch.nn.Module, family: str, tp_mesh: DeviceMesh, after: list) -> dict:
    """The plan of one decoder layer: its attention, its MLP or mixture of experts, its norms (module docstring).
    MoE experts and fused projections are split here directly (their weights and forwards); `after` receives
    what must follow the plan's styles."""
    plan = {}
    for name, child in layer.named_children():
        params = list(child.parameters())
        if name in ATTENTION_NAMES:
            plan |= _attention_plan(name, child, family, tp_mesh, after)
        elif name in MLP_NAMES:
            plan |= _mlp_plan(name, child, family, tp_mesh)
        elif params and all(p.dim() == 1 for p in params):  # a norm between the blocks: on its positions
            plan[name] = SequenceParallel(use_local_output=True)
        elif params:
            raise ConfigError(
                f"tensor parallelism does not know how to split {family}'s {type(child).__name__} ({name}); "
                f"set training.parallel.tp=1"
            )
    return plan


def _linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The projections under `module` by name: its linears, a LoRA-adapted one (PEFT's layer around it) under its
    own name, planned as the linear (parallel/lora_tensor.py splits its adapter)."""
    found = {}
    for name, child in module.named_modules():
        if is_adapted(child):
            found[name] = child
        elif isinstance(child, torch.nn.Linear) and ".lora_" not in name and not name.endswith("base_layer"):
            found[name] = child
    return found


def _attention_plan(name: str, attention: torch.nn.Module, family: str, tp_mesh: DeviceMesh, after: list) -> dict:
    linears = _linears(attention)
    if "o_proj" not in linears:
        raise ConfigError(
            f"tensor parallelism does not know how to split {family}'s {type(attention).__name__} (no o_proj); "
            f"set training.parallel.tp=1"
        )
    plan = {
        name: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
    }
    head_dim = getattr(attention, "head_dim", None)
    others = {n: p for n, p in attention.named_parameters() if n.split(".")[0] not in HEAD_PROJECTIONS}
    per_head_norms = all(n.split(".")[0] in ("q_norm", "k_norm") and p.numel() == head_dim for n, p in others.items())
    if head_dim and set(linears) == HEAD_PROJECTIONS and per_head_norms:  # split by heads
        plan |= {f"{name}.{proj}": ColwiseParallel() for proj in ("q_proj", "k_proj", "v_proj")}
        plan[f"{name}.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        for norm in ("q_norm", "k_norm"):  # per-head norms over [.., heads, head_dim]: this rank's heads
            if hasattr(attention, norm):
                plan[f"{name}.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        _share_kv_heads(attention, name, plan, tp_mesh, after)
        return plan
    # gathered: projections split column-wise and gathered, the attention core whole on every rank
    plan |= {f"{name}.{proj}": ColwiseParallel(output_layouts=Replicate()) for proj in linears if proj != "o_proj"}
    plan[f"{name}.o_proj"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    return plan


def _share_kv_heads(attention: torch.nn.Module, name: str, plan: dict, tp_mesh: DeviceMesh, after: list) -> None:
    """Fewer key/value heads than ranks (tp a multiple of them): k/v are gathered whole and each rank keeps the kv
    head of its query heads; their gradients are summed over the ranks that share it (`copy_to_ranks`)."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    kv_size = attention.k_proj.out_features
    kv_heads = kv_size // attention.head_dim
    if kv_heads >= tp:
        return
    heads = attention.q_proj.out_features // attention.head_dim
    kv_head = (rank * heads // tp) // (heads // kv_heads)
    group = tp_mesh.get_group()
    head_slice = slice(kv_head * attention.head_dim, (kv_head + 1) * attention.head_dim)
    for proj in ("k_proj", "v_proj"):
        plan[f"{name}.{proj}"] = ColwiseParallel(output_layouts=Replicate())
        hook = lambda module, args, out: copy_to_ranks(out, group)[..., head_slice]  # noqa: E731
        after.append(lambda module=getattr(attention, proj), hook=hook: module.register_forward_hook(hook))
    attention.num_key_value_groups = heads // tp  # this rank's query heads share its one kv head


def _mlp_plan(name: str, mlp: torch.nn.Module, family: str, tp_mesh: DeviceMesh) -> dict:
    experts = getattr(mlp, "experts", None)
    if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), torch.nn.Parameter):
        return _moe_plan(name, mlp, family, tp_mesh)
    plan = {name: PrepareModuleInput(input_layouts=(Shard(1),), **GATHERED)}
    return plan | _dense_mlp_plan(name, mlp, family, tp_mesh, Shard(1))


def _dense_mlp_plan(name: str, mlp: torch.nn.Module, family: str, tp_mesh: DeviceMesh, output) -> dict:
    """gate/up column-wise, down row-wise with its partial sums reduced to `output` (Shard(1): reduce-scattered
    over the sequence; Replicate: all-reduced). A fused [gate; up] projection (Phi-3's gate_up_proj) is split
    column-wise and its output gathered, [gate; up] whole on every rank, down row-wise on this rank's columns
    (transformers' colwise_gather_output and rowwise_split_input): a split of gate and up halves each
    (`_StridedShard`) is neither gathered in order under FSDP2's shards of the same dimension nor written by DCP."""
    linears = _linears(mlp)
    if "down_proj" not in linears or not {"gate_proj", "up_proj", "gate_up_proj"} & set(linears):
        raise ConfigError(
            f"tensor parallelism does not know how to split {family}'s {type(mlp).__name__} ({name}); "
            f"set training.parallel.tp=1"
        )
    if "gate_up_proj" in linears:
        return {
            f"{name}.gate_up_proj": ColwiseParallel(output_layouts=Replicate()),
            f"{name}.down_proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=output),
        }
    plan = {f"{name}.down_proj": RowwiseParallel(output_layouts=output)}
    for proj in [proj for proj in linears if proj != "down_proj"]:  # in module order: the same on every rank
        plan[f"{name}.{proj}"] = ColwiseParallel()
    return plan


def _moe_plan(name: str, block: torch.nn.Module, family: str, tp_mesh: DeviceMesh) -> dict:
    """The block on the gathered sequence, its experts' intermediate dimension split (`shard_experts_tp`), shared
    experts column/row-wise with all-reduced outputs, the router replicated; the output cut to this rank's
    positions."""
    shard_experts_tp(block.experts, tp_mesh)
    plan = {name: PrepareModuleInput(input_layouts=(Shard(1),), **GATHERED)}
    for child_name, child in block.named_children():
        if child_name != "experts" and {"down_proj"} <= set(_linears(child)):  # shared experts
            plan |= _dense_mlp_plan(f"{name}.{child_name}", child, family, tp_mesh, Replicate())
    block.register_forward_hook(_to_own_positions(tp_mesh))
    return plan


def _to_own_positions(tp_mesh: DeviceMesh):
    """A hook cutting a block's whole [B, W, H] output (equal on every rank) to this rank's W / tp positions; the
    backward all-gathers the positions' gradients."""

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        local = DTensor.from_local(first, tp_mesh, [Replicate()], run_check=False)
        local = local.redistribute(tp_mesh, [Shard(1)]).to_local()
        return (local, *output[1:]) if isinstance(output, tuple) else local

    return hook


def expert_placements(experts: torch.nn.Module) -> dict[str, object]:
    """Each fused expert weight's tensor-parallel placement: contiguous blocks of the [gate; up] (or interleaved
    [g0, u0, g1, u1, ..]) dimension and of the intermediate one. Contiguous, so checkpoints (DCP: one chunk per
    rank) and gathers see plain shards; a concatenated [gate; up] block is gathered in the forward
    (`expert_mlps`)."""
    transposed, _, has_bias = expert_layout(experts)
    placements = {"gate_up_proj": Shard(2 if transposed else 1), "down_proj": Shard(1 if transposed else 2)}
    if has_bias:  # the down projection's bias is added once, on tp rank 0 (`expert_mlps`)
        placements["gate_up_proj_bias"] = Shard(1)
    return placements


def shard_experts_tp(experts: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """The experts' weights split over `tp_mesh` (`expert_placements`) and their forward on local weights; the
    inputs' gradients summed over the ranks and the partial outputs all-reduced (hooks, so expert parallelism's
    dispatching forward keeps them)."""
    for name, placement in expert_placements(experts).items():
        _distribute(experts, name, tp_mesh, placement)
    group = tp_mesh.get_group()
    experts.tp_group, experts.tp_rank = group, tp_mesh.get_local_rank()
    experts.forward = types.MethodType(_local_experts_forward, experts)

    def inputs(module, args):  # (hidden [N, H], top_k_index [N, K], top_k_weights [N, K])
        return (copy_to_ranks(args[0], group), args[1], copy_to_ranks(args[2], group), *args[3:])

    experts.register_forward_pre_hook(inputs)
    experts.register_forward_hook(lambda module, args, output: sum_over_ranks(output, group))


def _distribute(module: torch.nn.Module, name: str, tp_mesh: DeviceMesh, placement) -> None:
    """`module.name` replaced by a parameter of the same full value, a DTensor placed by `placement` on `tp_mesh`
    (every rank loaded the same weights: each keeps its part, no communication)."""
    weight = getattr(module, name)
    sharded = distribute_tensor(weight.detach(), tp_mesh, [placement], src_data_rank=None)
    setattr(module, name, torch.nn.Parameter(sharded, requires_grad=weight.requires_grad))


def _local_experts_forward(self, hidden_NH: torch.Tensor, index_NK: torch.Tensor, weights_NK: torch.Tensor):
    """transformers' eager experts loop on this rank's slice of each expert's intermediate dimension (`expert_mlps`):
    a partial sum of the output, all-reduced by the hook."""
    out_NH = torch.zeros_like(hidden_NH)
    routes = [torch.where(index_NK == expert) for expert in range(self.gate_up_proj.shape[0])]
    outputs = expert_mlps(self, [hidden_NH[token] for token, _ in routes])
    for (token, slot), y in zip(routes, outputs, strict=True):
        out_NH.index_add_(0, token, (y * weights_NK[token, slot, None]).to(out_NH.dtype))
    return out_NH
