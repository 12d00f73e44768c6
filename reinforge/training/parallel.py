"""The layout of the training ranks: `training.parallel`, its device mesh, and tensor parallelism of the model.

`training.num_workers` ranks form a 4-D device mesh (PyTorch's `DeviceMesh`), outermost first:

- `dp_replicate`: copies of the model (HSDP's replicate dimension: gradients all-reduced between copies);
- `dp_shard`: FSDP2's shards within a copy (gradients reduce-scattered);
- `cp`: context parallelism, a sequence split over ranks (Ulysses all-to-all, training/ulysses.py);
- `tp`: tensor parallelism with sequence parallelism (PyTorch's `parallelize_module`), innermost, so that
  its ranks are neighbours (one node's NVLink on GPU).

Ranks that differ only in `cp` or `tp` train on the same sequences; the batch is shared over
`dp_replicate x dp_shard` ranks. FSDP2 shards the parameters over `dp_shard x cp` (cp ranks hold the same
weights, so they shard them like data-parallel ranks, as torchtitan does) and replicates over `dp_replicate`.
Expert parallelism (`ep`) borrows its ranks from `dp_shard x cp` (training/expert_parallel.py).

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
import os
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from reinforge.config.section import Section
from reinforge.errors import ConfigError
from reinforge.modeling import model_location
from reinforge.training.expert_parallel import check_expert_layout

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
TP_FAMILIES = ("qwen2", "qwen3", "llama", "mistral")


class ParallelConfig(Section):
    """`training.parallel`: how `training.num_workers` ranks split the work (their product is the rank count)."""

    dp_shard: int = Field(default=-1, ge=-1)
    """FSDP2 shards of each model copy; -1: the ranks the other dimensions leave."""
    dp_replicate: int = Field(default=1, ge=1)
    """Model copies (HSDP: FSDP2 within a copy, gradients all-reduced between copies; e.g. one copy per node)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel ranks (with sequence parallelism): heads, MLP columns and the vocabulary split over them.
    It must divide the attention heads, the key/value heads and the MLP's intermediate size."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel ranks: each sequence's positions split over them (Ulysses: heads / tp must divide by cp)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel ranks of a mixture-of-experts model: its experts split over them, tokens sent to their
    experts' rank by all-to-all (training/expert_parallel.py). Borrowed from FSDP2's shard ranks, not added to
    them: it must divide dp_shard x cp and the experts per layer."""

    def resolved(self, num_workers: int) -> "ParallelConfig":
        """With `dp_shard` filled in; a one-line error when the dimensions do not multiply to `num_workers`."""
        others = self.dp_replicate * self.tp * self.cp
        dp_shard = num_workers // others if self.dp_shard == -1 else self.dp_shard
        if dp_shard < 1 or others * dp_shard != num_workers:
            raise ConfigError(
                f"training.parallel: dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} must multiply to training.num_workers={num_workers}; "
                f"e.g. training.num_workers={others * max(dp_shard, 1)}, or dp_shard=-1 with a num_workers that "
                f"{others} divides"
            )
        if (dp_shard * self.cp) % self.ep:
            divisors = [e for e in range(1, dp_shard * self.cp + 1) if dp_shard * self.cp % e == 0]
            raise ConfigError(
                f"training.parallel.ep={self.ep} must divide dp_shard x cp = {dp_shard} x {self.cp} (expert "
                f"parallelism borrows FSDP2's shard ranks); the nearest valid ep is "
                f"{min(divisors, key=lambda e: (abs(e - self.ep), e))}"
            )
        return self.model_copy(update={"dp_shard": dp_shard})

    @property
    def data_parallel(self) -> int:
        """Ranks with distinct shares of each batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def sequence_shards(self) -> int:
        """Pieces each row's positions are cut into (rows are padded to a multiple of it)."""
        return self.tp * self.cp

    def is_plain(self) -> bool:
        """Data parallelism only: no tensor or context parallelism."""
        return self.tp == 1 and self.cp == 1


ParallelSetting = ParallelConfig | Literal["auto"]


def check_layout(parallel: ParallelConfig, text_config) -> None:
    """The model can be split this way: a one-line error naming the nearest valid tp, cp or ep otherwise."""
    check_expert_layout(parallel, text_config)
    heads, kv_heads = text_config.num_attention_heads, getattr(text_config, "num_key_value_heads", None)
    kv_heads = kv_heads or heads
    if parallel.tp > 1:
        if text_config.model_type not in TP_FAMILIES:
            raise ConfigError(
                f"tensor parallelism (training.parallel.tp={parallel.tp}) supports the model families "
                f"{', '.join(TP_FAMILIES)}, not {text_config.model_type}; set training.parallel.tp=1"
            )
        sizes = {"attention heads": heads, "key/value heads": kv_heads, "MLP columns": text_config.intermediate_size}
        valid = [t for t in range(1, parallel.tp * 2 + 1) if all(size % t == 0 for size in sizes.values())]
        bad = [f"{name} ({size})" for name, size in sizes.items() if size % parallel.tp]
        if bad:
            nearest = min(valid, key=lambda t: (abs(t - parallel.tp), t))
            raise ConfigError(
                f"training.parallel.tp={parallel.tp} does not divide the model's {', '.join(bad)}; "
                f"the nearest valid tp is {nearest}"
            )
    if parallel.cp > 1:
        local_heads = heads // parallel.tp
        if local_heads % parallel.cp:
            valid = [c for c in range(1, local_heads + 1) if local_heads % c == 0]
            nearest = min(valid, key=lambda c: (abs(c - parallel.cp), c))
            raise ConfigError(
                f"training.parallel.cp={parallel.cp} must divide the attention heads per tensor-parallel rank "
                f"({heads} / tp {parallel.tp} = {local_heads}) for Ulysses' head scatter; "
                f"the nearest valid cp is {nearest}"
            )


def build_mesh(device_type: str, parallel: ParallelConfig) -> DeviceMesh:
    """The 4-D mesh (MESH_DIMS) with the flattened dimensions the strategy uses: `dp` (the batch's shares),
    `dp_shard_cp` (FSDP2's shard dimension) and `dp_cp` (the ranks whose gradients are summed)."""
    shape = (parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def fsdp_mesh(mesh: DeviceMesh, parallel: ParallelConfig) -> DeviceMesh:
    """FSDP2's mesh: shards over dp_shard x cp, and HSDP's replicate dimension when there are copies."""
    if parallel.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


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
    weight: DTensor, hidden_NH: torch.Tensor, targets_NK: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N, K] of the target ids under softmax(hidden @ W.T / temperature) and the entropies [N], from
    this rank's rows of the vocabulary (`weight`: [V, H] sharded on V, torch.chunk's uneven split): the
    log-sum-exp, the target logits and the entropy's sum are all-reduced over the tensor-parallel ranks as [N]
    or [N, K] values, so the [N, V] logits never exist whole. Equal to the full-vocabulary formula
    (micro_batching.py, `head_chunk`)."""
    mesh = weight.device_mesh
    group = mesh.get_group(mesh.ndim - 1)
    rank, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    local_W = weight.to_local()
    start = rank * math.ceil(weight.shape[0] / size)  # torch.chunk's split: equal chunks, the last smaller
    logits_NV = F.linear(_CopyToRanks.apply(hidden_NH, group), local_W).float() / temperature
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


def _by_mesh(tensors: list[torch.Tensor], key=lambda t: t) -> list[list[torch.Tensor]]:
    """Groups of tensors whose (gradient) DTensors share a mesh and placements; plain tensors form one group."""
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for tensor in tensors:
        value = key(tensor)
        groups.setdefault((value.device_mesh, value.placements) if isinstance(value, DTensor) else None, []).append(
            tensor
        )
    return list(groups.values())


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm of gradients that are DTensors on different meshes (FSDP2 x TP's 2-D mesh beside
    FSDP2's 1-D one) or plain tensors, each group of one mesh reducing its own norm; the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    squares = []
    for grads in _by_mesh([p.grad for p in parameters]):
        norm = torch.nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for group in _by_mesh(parameters, key=lambda p: p.grad):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


# --- training.parallel=auto ---------------------------------------------------------------------------


def resolve_auto(
    training, model_config, seq_len: int, kl: bool = False, generation: str = "none", num_gpus_per_worker: float = 0
):
    """`training` with `parallel=auto` replaced by the planner's layout (training/planner.py) for its
    `num_workers` ranks of this machine's accelerator (the driver's GPU; on CPU, the host's memory shared by the
    ranks), and the one line that says which; as it is (and None) otherwise. `seq_len`: the longest sequence;
    `generation`: where an engine sits ("colocated", "separate" or "none")."""
    if training.parallel != "auto":
        return training, None
    if training.backend == "torch":
        return training.model_copy(update={"parallel": ParallelConfig()}), None
    from reinforge.training.planner import auto_layout

    if torch.cuda.is_available():
        device, memory_gb = "gpu", torch.cuda.get_device_properties(0).total_memory / 2**30
    elif num_gpus_per_worker > 0:
        raise ConfigError(
            "training.parallel=auto needs the GPUs' memory, and this driver has no GPU; run it on a GPU node or set "
            "training.parallel's dp_shard, tp and cp (`reinforge plan` prints a layout)"
        )
    else:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        device, memory_gb = "cpu", host_bytes / 2**30 / training.num_workers
    tokens = training.micro_batch_tokens if getattr(training, "micro_batch_tokens", None) else seq_len
    located = model_config.model_copy(update={"name_or_path": model_location(model_config)})
    layout = auto_layout(
        located, training.num_workers, memory_gb, seq_len, training.activation_checkpointing,
        micro_batch_tokens=tokens, logprob_chunk_tokens=training.logprob_chunk_tokens, kl=kl,
        generation=generation, device=device,
    )  # fmt: skip
    parallel = ParallelConfig(**layout)
    line = (
        f"training.parallel=auto: dp_replicate={parallel.dp_replicate} dp_shard={parallel.dp_shard} "
        f"tp={parallel.tp} cp={parallel.cp} for {training.num_workers} ranks of {memory_gb:.0f} GiB ({device})"
    )
    return training.model_copy(update={"parallel": parallel}), line
