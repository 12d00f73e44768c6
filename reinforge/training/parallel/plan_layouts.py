"""The layouts the planner (planner.py) considers, the workload it plans for, and how it ranks their speed.

A layout is `Layout(dp_replicate, dp_shard, tp, cp, ep, pp)` as training/parallel/ runs it: `pp` pipeline stages
(outermost, each a contiguous run of the decoder's layers), and within a stage FSDP2 shards over dp_shard x cp
x tp ranks and replicates over dp_replicate; ep borrows its ranks from dp_shard x cp. The candidates
(`candidate_layouts`): pp a divisor of the node count (each stage whole nodes, so that its FSDP2, tp, cp and ep
groups stay inside its nodes and only activations cross between stages) up to the layer count; tp a power of
two within a node dividing the attention heads, the key/value heads and the MLP's columns (an MoE model's expert
width too), for a family tensor parallelism splits; cp (Ulysses) a divisor of the heads per tp rank, tp x cp
within one node; dp the rest of a stage, one FSDP2 group or HSDP with copies of whole nodes; ep the largest
that divides dp_shard x cp and the experts, and the largest of those within a node.

Speed (`relative_step_time`) only ranks the layouts that fit; it predicts no seconds. Rules of thumb, stated so
that the choice can be argued with:
- activation checkpointing recomputes the forward: +20% (measured: 4.50 s against 3.75 s, docs/benchmarks.md,
  1.5B on one H200);
- each doubling of tp +10% (its all-gathers and reduce-scatters of activations are on every layer's critical
  path and their volume per GPU does not fall as tp grows); each doubling of cp +5% (Ulysses' all-to-alls);
- FSDP2's all-gathers (forward and backward, b bytes per parameter each) and reduce-scatter (fp32 gradients, 4
  bytes) of every micro-batch overlap the compute, so the step takes the longer of the two: + (communication /
  compute - 1) when the network is the slower, with an H100's `GPU_TFLOPS` of bf16 work against `NVLINK_GBPS`
  per GPU within a node or `INTER_NODE_GBPS` when the group is wider than a node (then +10% at least). Per GPU
  and micro-batch the all-gathers move (2b + 4) x the stage's weights / tp (an MoE model's experts only when
  FSDP2 shards them: ep < dp_shard x cp) and the compute is 6 x the stage's active parameters x T / (tp x cp);
- expert parallelism wider than a node (ep x tp > GPUs per node): its all-to-alls (each token's top_k copies of
  H sent to their experts and back, forward and backward) wait on the inter-node network, not overlapped:
  + their time against the compute, for the share that leaves the node (`expert_network_ratio`);
- pipeline parallelism: the bubble, pp - 1 of the m + pp - 1 slots of each pass idle (1F1B and GPipe alike), so
  the step takes (m + pp - 1) / m of its time, and each micro-batch's activations and their gradients cross
  every stage boundary on the critical path (2 x T / (tp x cp) x H x b bytes per GPU against the stage's
  compute on those tokens).
Ties go to the smaller tp, then the smaller cp, then the smaller pp, then the layout that needs the least memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from reinforge.training.parallel.model_shape import LORA_TARGETS, ModelShape

AC_COST, TP_COST, CP_COST, CROSS_NODE_FSDP_COST = 0.20, 0.10, 0.05, 0.10
GPU_TFLOPS = 400.0  # bf16 work per GPU and second: an H100's 989 dense peak at 40% MFU
INTER_NODE_GBPS = 50.0  # GB/s per GPU between nodes: one 400 Gb/s NIC per GPU (InfiniBand NDR)
NVLINK_GBPS = 450.0  # GB/s per GPU and direction within a node: an H100's NVLink
MICROBATCHES_PER_STAGE = 4  # pipeline micro-batches per stage when the workload gives none: a bubble under 20%


@dataclass(frozen=True)
class Layout:
    """How the GPUs split the work; the product of the five is the GPU count (ep borrows from dp_shard x cp)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ep: int = 1  # expert-parallel ranks of an MoE model
    pp: int = 1  # pipeline stages

    @property
    def gpus(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def shard_group(self) -> int:
        """The ranks of a stage that share one copy of its weights, gradients and AdamW state; an MoE model's
        experts too (split over ep x tp, FSDP2-sharded over the other dp_shard x cp / ep)."""
        return self.dp_shard * self.cp * self.tp

    def fields(self) -> dict[str, int]:
        """As training.parallel's fields (ep and pp only when above 1)."""
        fields = dict(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, cp=self.cp)
        return fields | ({"ep": self.ep} if self.ep > 1 else {}) | ({"pp": self.pp} if self.pp > 1 else {})

    def __str__(self) -> str:
        pp, ep = f"pp={self.pp} " if self.pp > 1 else "", f" ep={self.ep}" if self.ep > 1 else ""
        return f"{pp}dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} cp={self.cp}{ep}"


@dataclass(frozen=True)
class Workload:
    """What one training step holds: `reinforge plan`'s options."""

    seq_len: int
    """The longest sequence (prompt + response), tokens; the KV cache holds this many per sequence."""
    micro_batch_tokens: int | None = None
    """Tokens of one micro-batch of one data-parallel rank (training.micro_batch_tokens); None: seq_len."""
    logprob_chunk_tokens: int = 2048
    kl: bool = False
    """A frozen reference model for the KL term (loss.kl_coef > 0)."""
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = LORA_TARGETS
    generation: Literal["colocated", "separate", "none"] = "colocated"
    generation_sequences: int = 16
    """Sequences the engine holds in its KV cache at once, each of seq_len tokens (vLLM batches as many as its
    cache holds: fewer only make generation slower)."""
    generation_tp: int | None = None
    """The engine's tensor-parallel size; None: the smallest power of two that fits."""
    device: Literal["gpu", "cpu"] = "gpu"
    """gpu: bf16 compute, fp32 master weights; cpu: fp32 compute, one process per rank."""
    runtime_gib: float | None = None
    """The fixed overhead per GPU (process); None: GPU_RUNTIME_GIB or CPU_PROCESS_GIB."""
    pp_schedule: Literal["1F1B", "GPipe"] = "1F1B"
    """The pipeline's schedule (training.parallel.pp_schedule)."""
    pp_microbatches: int | None = None
    """Micro-batches of one pipeline pass (training.parallel.pp_microbatches); None: MICROBATCHES_PER_STAGE x pp."""

    @property
    def element_bytes(self) -> int:
        return 2 if self.device == "gpu" else 4

    @property
    def tokens(self) -> int:
        return self.micro_batch_tokens or self.seq_len

    def microbatches(self, pp: int) -> int:
        return self.pp_microbatches or MICROBATCHES_PER_STAGE * pp

    def held_microbatches(self, pp: int, stage: int) -> int:
        """Micro-batches whose activations `stage` holds at once: 1F1B min(m, pp - stage) (the first stage runs pp
        forwards before its first backward), GPipe all m (every forward before any backward); one without pp."""
        if pp == 1:
            return 1
        m = self.microbatches(pp)
        return m if self.pp_schedule == "GPipe" else min(m, pp - stage)


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per stage: contiguous runs, the earlier stages taking the extra layer (pipeline.py's split)."""
    return [num_layers // pp + (stage < num_layers % pp) for stage in range(pp)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, gpus: int, gpus_per_node: int = 8) -> list[Layout]:
    """Every layout the planner considers (module docstring), smallest pp, tp, cp and dp_replicate first."""
    node = min(gpus_per_node, gpus)
    nodes = gpus // node if gpus % node == 0 else 1
    sizes = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size)
    sizes += (shape.moe_intermediate_size,) if shape.moe else ()
    splits = [t for t in _divisors(node) if t & (t - 1) == 0 and all(size % t == 0 for size in sizes)]
    layouts = []
    for pp in (p for p in _divisors(nodes) if p <= shape.num_hidden_layers):
        stage_gpus, stage_nodes = gpus // pp, nodes // pp
        for tp in splits if shape.tensor_parallel else [1]:
            local_heads = shape.num_attention_heads // tp
            for cp in (c for c in _divisors(node // tp) if local_heads % c == 0 and stage_gpus % (tp * c) == 0):
                dp = stage_gpus // (tp * cp)
                for replicate in (r for r in _divisors(stage_nodes) if dp % r == 0):
                    shard = dp // replicate
                    for ep in _expert_splits(shape, shard * cp, node // tp):
                        layouts.append(Layout(replicate, shard, tp, cp, ep, pp))
    return layouts


def _expert_splits(shape: ModelShape, shard_ranks: int, node_ranks: int) -> list[int]:
    """ep of an MoE model: the largest that divides dp_shard x cp and the experts (FSDP2 then gathers no expert),
    and the largest within a node (its all-to-alls on the node's links); [1] for a dense model."""
    if not shape.moe:
        return [1]
    valid = [e for e in _divisors(shard_ranks) if shape.num_experts % e == 0]
    return sorted({max(valid), max(e for e in valid if e <= node_ranks)}, reverse=True)


def stage_parameters(shape: ModelShape, pp: int, stage: int) -> int:
    """Parameters a stage holds: its layers, the embedding on the first, the final norm and LM head on the last (a
    tied head is a copy of its own there when pp > 1: pipeline.py)."""
    layers = stage_layer_counts(shape.num_hidden_layers, pp)[stage]
    if pp == 1:
        return layers * shape.layer_parameters() + shape.root_parameters()
    embedding = shape.vocab_size * shape.hidden_size
    head = embedding + shape.hidden_size
    return layers * shape.layer_parameters() + embedding * (stage == 0) + head * (stage == pp - 1)


def bubble(pp: int, microbatches: int) -> float:
    """The idle share of a pipeline pass, (pp - 1) / (m + pp - 1), for 1F1B and GPipe alike."""
    return (pp - 1) / (microbatches + pp - 1)


def fsdp_network_ratio(
    shape: ModelShape, layout: Layout, workload: Workload, gbps: float = INTER_NODE_GBPS
) -> float:  # fmt: skip
    """The time of FSDP2's all-gathers and reduce-scatter of one micro-batch at `gbps` per GPU against its compute,
    per GPU of the first (largest) stage (module docstring)."""
    layers = stage_layer_counts(shape.num_hidden_layers, layout.pp)[0]
    experts = layers * shape.expert_parameters()
    dense = stage_parameters(shape, layout.pp, 0) - experts
    gathered = (dense + (experts if layout.dp_shard * layout.cp > layout.ep else 0)) / layout.tp
    per_parameter = 2 * workload.element_bytes + (0 if workload.lora_rank else 4)  # LoRA: no base gradients
    network = gathered * per_parameter / (gbps * 1e9)
    return network / _stage_compute_seconds(shape, layout, workload, layers)


def _stage_compute_seconds(shape: ModelShape, layout: Layout, workload: Workload, layers: int) -> float:
    """One micro-batch's forward and backward through `layers` layers on one GPU: 6 x active parameters x tokens."""
    active = shape.active_parameters() - shape.root_parameters()
    tokens = workload.tokens / (layout.tp * layout.cp)
    return 6 * active * layers / shape.num_hidden_layers * tokens / (GPU_TFLOPS * 1e12)


def pipeline_ratio(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """A micro-batch's activations and gradients sent over a stage boundary against the stage's compute on them."""
    if layout.pp == 1:
        return 0.0
    tokens = workload.tokens / (layout.tp * layout.cp)
    network = 2 * tokens * shape.hidden_size * workload.element_bytes / (INTER_NODE_GBPS * 1e9)
    layers = stage_layer_counts(shape.num_hidden_layers, layout.pp)[0]
    return network / _stage_compute_seconds(shape, layout, workload, layers)


def expert_network_ratio(shape: ModelShape, layout: Layout, gpus_per_node: int) -> float:
    """The all-to-alls of expert parallelism that leave a node, against the compute, per GPU and micro-batch: each
    token's top_k copies of H sent to their experts and back, in the forward and the backward (4 top_k H b per
    token and layer, every tp rank sending its gathered sequence's), the share (ep - ranks in a node) / ep crossing;
    0 when an ep group (ep x tp GPUs) sits in one node."""
    if not shape.moe or layout.ep * layout.tp <= gpus_per_node:
        return 0.0
    crossing = (layout.ep - max(gpus_per_node // layout.tp, 1)) / layout.ep
    per_token = 4 * shape.num_experts_per_tok * shape.hidden_size * 2 * crossing * layout.tp  # bf16, / tp below
    active = (shape.active_parameters() - shape.root_parameters()) / shape.num_hidden_layers
    return per_token / (INTER_NODE_GBPS * 1e9) / (6 * active / (GPU_TFLOPS * 1e12))


def relative_step_time(
    layout: Layout, activation_checkpointing: bool, gpus_per_node: int = 8, shape: ModelShape | None = None,
    workload: Workload | None = None,
) -> float:  # fmt: skip
    """A rank of speed, 1.0 the fastest possible (module docstring): no seconds, only an order. Without `shape`
    and `workload` (or for CPU ranks, where the GPU's compute and network figures say nothing), a cross-node FSDP2
    group costs its 10% floor and pp its bubble at the default micro-batches."""
    time = (
        (1 + AC_COST * activation_checkpointing)
        * (1 + TP_COST * math.log2(layout.tp))
        * (1 + CP_COST * math.log2(layout.cp))
    )
    cross_node = layout.shard_group > gpus_per_node
    if workload is not None and workload.device == "cpu":  # gloo ranks of one host: the GPU figures do not apply
        shape = workload = None
    if layout.dp_shard * layout.cp > 1 and shape and workload:
        gbps = INTER_NODE_GBPS if cross_node else NVLINK_GBPS
        time *= 1 + max(CROSS_NODE_FSDP_COST * cross_node, fsdp_network_ratio(shape, layout, workload, gbps) - 1)
    elif cross_node:
        time *= 1 + CROSS_NODE_FSDP_COST
    if shape is not None:
        time *= 1 + expert_network_ratio(shape, layout, gpus_per_node)  # not overlapped: dispatch, experts, combine
    if layout.pp > 1:
        m = (workload or Workload(1)).microbatches(layout.pp)
        time *= (m + layout.pp - 1) / m * (1 + (pipeline_ratio(shape, layout, workload) if shape and workload else 0))
    return time
