"""The layout planner (`reinforge plan`, `training.parallel=auto`): memory per GPU of each way to split a model
over N GPUs, and the fastest split that fits.

A layout is `Layout(dp_replicate, dp_shard, tp, cp)` as training/parallel/ runs it: FSDP2 shards the weights,
gradients and AdamW state over dp_shard x cp x tp ranks (cp ranks shard like data-parallel ones, tp ranks hold
a 1/tp slice of every matrix and of the vocabulary) and replicates them over dp_replicate (HSDP). The candidates
(`candidate_layouts`): tp a power of two up to the GPUs of one node that divides the attention heads, the
key/value heads and the MLP's columns (not one sharing kv heads over ranks, which tensor_plan.py can), for a
family tensor parallelism splits (`ModelShape.tensor_parallel`); cp (Ulysses) a
divisor of the heads per tp rank, tp x cp within one node (their collectives run every layer); dp the rest,
either one FSDP2 group over all of it (dp_replicate 1) or HSDP with copies of whole nodes (dp_replicate a
divisor of the node count).

Memory per GPU (`memory_terms`), in bytes, for a Llama/Qwen2 decoder (hidden H, L layers, MLP width I,
vocabulary V, attention width Q = heads x head dim; b bytes per element of compute, 2 for bf16 on GPU, 4 for
fp32 on CPU; S = dp_shard x cp x tp; T = micro-batch tokens per GPU = micro_batch_tokens / cp):
- params: 4 P / S, the fp32 master weights (P parameters, `ModelShape.parameters`; with LoRA the base too);
- gathered: FSDP2's all-gathered copies, in compute dtype, tp-sliced: two decoder layers (the one computing
  and the next, prefetched), the root (embeddings, untied LM head: FSDP2 keeps it unsharded from the forward
  to the backward) and one layer's and the root's gradient before the reduce-scatter (none with LoRA). None
  on CPU in one process: fp32 compute uses the weights in place;
- grads 4 P_t / S and optimizer 8 P_t / S (AdamW's two fp32 moments), P_t the trained parameters: all of
  them, or with LoRA the adapters' only; the gradients are freed after each optimizer step (training/backend.py),
  so they are not resident while a colocated engine generates;
- activations, what autograd keeps of each layer per token (`activation_bytes_per_token`, counted from
  transformers' Qwen2/Llama layer with reinforge's packed segment attention): each RMSNorm keeps its fp32
  input, its normalised value and its output, H (4 + 2b); attention keeps the gathered queries, keys and
  values repeated to every head, its output and o_proj's input, 5 Q b, and an fp32 log-sum-exp per head; the
  SwiGLU MLP keeps gate, silu(gate), up and their product, 4 I b. No T^2 term: flash/efficient attention.
  Without activation checkpointing L x T x that / tp (sequence parallelism shards all of it over tp, as in
  Korthikanti et al. 2022); with it, each layer's input only (L x T x H x b / tp) plus one layer recomputed;
- logits: the chunked LM head (training/micro_batching.py): one chunk of min(logprob_chunk_tokens, T) tokens,
  [chunk, V / tp] logits in compute dtype plus three fp32 tensors of that size (the upcast, its log-softmax or
  exp, the gradient), and the final norm's and the head's inputs, T H (4 + 3b) / tp;
- reference (with a KL term, without LoRA): a frozen copy of the policy, 4 P / S;
- engine weights (2 P / engine tp, bf16) and KV cache (L x 2 x max(kv heads / engine tp, 1) x head dim x
  generation_sequences x seq_len x 2 B): colocated, the engine sleeps while the trainer works
  (`generation.vllm.sleep_mode`, on on GPU), so the GPU holds the larger of the training phase and the
  generation phase (weights, AdamW state and reference, which stay, plus the engine); separate, the
  engine's GPUs are other GPUs and must hold it alone. The engine's tensor-parallel size is the smallest of the
  candidates the run accepts (engine_layout.py, `engine_candidates`: the same rules as the run's checks) that
  fits: colocated, one engine per tp training GPUs; separate, one engine on tp GPUs of its own;
- runtime: a fixed overhead, `GPU_RUNTIME_GIB` on GPU (CUDA context, NCCL buffers, the caching allocator's
  fragmentation: estimated, not measured here), `CPU_PROCESS_GIB` on CPU (a process that imported torch,
  transformers and reinforge's training backend, measured by bench/plan_memory.py).
A layout fits when every GPU keeps the safety margin (`MARGIN`, `reinforge plan --margin`, 10% of its memory by
default) free: the terms are estimates, and a GPU filled to the last estimated byte fails on the first larger
allocation. Validated against measured peaks: docs/benchmarks.md ("Planner") and docs/distributed.md ("The planner").

Mixture-of-experts models (model_shape.py; expert.py): the experts' P_e = L x E x 3 H
I_moe parameters are sharded over dp_shard x cp ranks only, split over ep of them and FSDP2-sharded over the
other dp_shard x cp / ep (tp ranks hold them whole): params 4 P_e, grads 4 P_e and AdamW 8 P_e, each / (dp_shard
x cp), beside the dense part's / S. ep is the largest that divides dp_shard x cp and E (it adds no rank; FSDP2
then gathers only a rank's E / ep experts: the gathered term counts E / ep experts per layer). Activations
follow the active parameters: a token's top_k routed copies each keep the expert's gate, silu(gate), up, their
product (4 I_moe b) and the token's hidden (H b), not divided by tp, and an fp32 router logit per expert.
`reinforge plan` prints both counts, total and active (a token's: top_k / E of the experts).

Speed (`relative_step_time`) only ranks the layouts that fit; it predicts no seconds. Activation checkpointing
recomputes the forward: +20% step time (measured: 4.50 s against 3.75 s, docs/benchmarks.md, 1.5B on one
H200). Each doubling of tp costs 10%: its all-gathers and reduce-scatters of activations are on the critical
path of every layer, and their volume per GPU does not fall as tp grows. Each doubling of cp costs 5%:
Ulysses' all-to-alls move 1/cp of the activations per GPU. An FSDP2 group wider than a node costs 10%: its
all-gathers of every layer cross the slower inter-node network; HSDP keeps them within its copy. These
factors are rules of thumb, stated so that the choice can be argued with; ties go to the smaller tp, then the
smaller cp, then the layout that needs the least memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from reinforge.errors import ConfigError
from reinforge.training.parallel.engine_layout import EngineLayout, engine_candidates
from reinforge.training.parallel.model_shape import (  # noqa: F401  (re-exported: the planner's API)
    KNOWN_MODELS,
    LORA_TARGETS,
    ModelShape,
    model_shape,
    shape_of_config,
)

GIB = 2**30
MARGIN = 0.10  # the share of every GPU's memory a layout leaves free (module docstring)
GPU_RUNTIME_GIB = 3.0
CPU_PROCESS_GIB = 0.42  # bench/plan_memory.py: peak RSS of a process that imported torch + transformers + backend
AC_COST, TP_COST, CP_COST, CROSS_NODE_FSDP_COST = 0.20, 0.10, 0.05, 0.10


@dataclass(frozen=True)
class Layout:
    """How the GPUs split the work; the product of the four is the GPU count (ep borrows from dp_shard x cp)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ep: int = 1  # expert-parallel ranks of an MoE model

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def shard_group(self) -> int:
        """The ranks that share one copy of the weights, gradients and AdamW state."""
        return self.dp_shard * self.cp * self.tp

    @property
    def expert_group(self) -> int:
        """The ranks that share one copy of the experts: ep x FSDP2's dp_shard x cp / ep, not tp."""
        return self.dp_shard * self.cp

    def __str__(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} cp={self.cp}{ep}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, gpus: int, gpus_per_node: int = 8) -> list[Layout]:
    """Every layout the planner considers (module docstring), smallest tp, cp and dp_replicate first."""
    node = min(gpus_per_node, gpus)
    sizes = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size)
    layouts = []
    splits = (t for t in _divisors(node) if t & (t - 1) == 0 and all(size % t == 0 for size in sizes))
    for tp in splits if shape.tensor_parallel else (1,):
        local_heads = shape.num_attention_heads // tp
        for cp in (c for c in _divisors(node // tp) if local_heads % c == 0 and gpus % (tp * c) == 0):
            dp = gpus // (tp * cp)
            nodes = gpus // node if gpus % node == 0 else 1
            for replicate in (r for r in _divisors(nodes) if dp % r == 0):
                shard = dp // replicate
                ep = max(e for e in _divisors(shard * cp) if shape.num_experts % e == 0) if shape.moe else 1
                layouts.append(Layout(replicate, shard, tp, cp, ep))
    return layouts


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

    @property
    def element_bytes(self) -> int:
        return 2 if self.device == "gpu" else 4

    @property
    def tokens(self) -> int:
        return self.micro_batch_tokens or self.seq_len


def activation_bytes_per_token(shape: ModelShape, element_bytes: int) -> float:
    """Bytes autograd keeps per token in one decoder layer (module docstring): two RMSNorms, attention, the dense
    MLP (an MoE layer's experts: `expert_activation_bytes_per_token`)."""
    b, q = element_bytes, shape.num_attention_heads * shape.head_size
    norms = 2 * shape.hidden_size * (4 + 2 * b)
    attention = 5 * q * b + 4 * shape.num_attention_heads
    return norms + attention + (0 if shape.moe else 4 * shape.intermediate_size * b)


def expert_activation_bytes_per_token(shape: ModelShape, element_bytes: int) -> float:
    """Bytes an MoE layer keeps per token for its experts (module docstring), not sliced by tp; 0 when dense."""
    if not shape.moe:
        return 0.0
    slot = 4 * shape.moe_intermediate_size * element_bytes + shape.hidden_size * element_bytes
    return shape.num_experts_per_tok * slot + 4 * shape.num_experts


def engine_terms(shape: ModelShape, workload: Workload, engine_tp: int) -> dict[str, float]:
    kv_heads = max(shape.num_key_value_heads // engine_tp, 1)  # vLLM replicates kv heads when tp exceeds them
    kv_tokens = workload.generation_sequences * workload.seq_len
    return {
        "engine weights": 2 * shape.parameters() / engine_tp,
        "kv cache": shape.num_hidden_layers * 2 * kv_heads * shape.head_size * kv_tokens * 2,
    }


def memory_terms(
    shape: ModelShape, layout: Layout, workload: Workload, activation_checkpointing: bool
) -> dict[str, float]:
    """Bytes per GPU of the training phase, term by term (module docstring); no engine."""
    b, tp, group, experts = workload.element_bytes, layout.tp, layout.shard_group, layout.expert_group
    lora = workload.lora_rank is not None
    adapters = shape.lora_parameters(workload.lora_rank, workload.lora_targets) if lora else 0
    expert = shape.num_hidden_layers * shape.expert_parameters()  # P_e: sharded over `experts` ranks only
    dense = shape.parameters() - expert
    weights = (dense + adapters) / group + expert / experts
    trained = adapters / group if lora else weights
    sharded = layout.dp_shard * layout.cp > 1
    gathered = 0.0
    if b < 4 or sharded:
        layer = (shape.layer_parameters() - shape.expert_parameters()) / tp + shape.expert_parameters() / layout.ep
        root = shape.root_parameters() / tp
        gathered = b * (2 * layer + root + (0 if lora else layer + root))
    tokens = workload.tokens / layout.cp
    per_layer = tokens * (activation_bytes_per_token(shape, b) / tp + expert_activation_bytes_per_token(shape, b))
    inputs = shape.num_hidden_layers * tokens * shape.hidden_size * b / tp
    chunk = min(workload.logprob_chunk_tokens, tokens)
    runtime = workload.runtime_gib
    if runtime is None:
        runtime = GPU_RUNTIME_GIB if workload.device == "gpu" else CPU_PROCESS_GIB
    return {
        "params": 4 * weights,
        "gathered": gathered,
        "grads": 4 * trained,
        "optimizer": 8 * trained,
        "activations": inputs + per_layer if activation_checkpointing else shape.num_hidden_layers * per_layer,
        "logits": chunk * math.ceil(shape.vocab_size / tp) * (b + 12) + tokens * shape.hidden_size * (4 + 3 * b) / tp,
        "reference": 4 * (dense / group + expert / experts) if workload.kl and not lora else 0.0,
        "runtime": runtime * GIB,
    }


PERSISTENT = ("params", "optimizer", "reference", "runtime")  # what stays while a colocated engine runs


@dataclass(frozen=True)
class Estimate:
    """One layout with or without activation checkpointing: its terms and the GPU memory it needs."""

    layout: Layout
    activation_checkpointing: bool
    terms: dict[str, float]
    engine: dict[str, float]
    engine_tp: int
    engine_layout: EngineLayout | None
    """The engines: how many, their tensor-parallel size, colocated or not (None: no engine)."""
    total: float
    """Bytes per training GPU: the training phase, or colocated the larger of it and the generation phase."""
    engine_total: float
    """Bytes per engine GPU when the engine is separate (0 otherwise)."""

    def fits(self, gpu_bytes: float) -> bool:
        return self.total <= gpu_bytes and self.engine_total <= gpu_bytes


def estimate(
    shape: ModelShape, layout: Layout, workload: Workload, activation_checkpointing: bool, gpu_bytes: float,
    gpus_per_node: int = 8,
) -> Estimate:  # fmt: skip
    terms = memory_terms(shape, layout, workload, activation_checkpointing)
    training = sum(terms.values())
    if workload.generation == "none":
        return Estimate(layout, activation_checkpointing, terms, {}, 0, None, training, 0.0)
    persistent = sum(terms[name] for name in PERSISTENT)
    resident = terms["runtime"] if workload.generation == "separate" else persistent  # beside the engine
    colocated = workload.generation == "colocated"
    candidates = engine_candidates(
        layout.gpus, gpus_per_node, shape.num_attention_heads, shape.num_key_value_heads, colocated
    )
    if workload.generation_tp:
        candidates = [c for c in candidates if c.tp == workload.generation_tp]
    if not candidates:
        raise ConfigError(
            f"no engine of tensor-parallel size {workload.generation_tp or 'any'} runs beside {layout} "
            f"({workload.generation}, {gpus_per_node} GPUs per node); see training/parallel/engine_layout.py's rules"
        )
    engines = next(
        (c for c in candidates if resident + sum(engine_terms(shape, workload, c.tp).values()) <= gpu_bytes),
        candidates[-1],
    )
    engine = engine_terms(shape, workload, engines.tp)
    if not colocated:
        return Estimate(
            layout, activation_checkpointing, terms, engine, engines.tp, engines, training,
            resident + sum(engine.values()),
        )  # fmt: skip
    total = max(training, persistent + sum(engine.values()))
    return Estimate(layout, activation_checkpointing, terms, engine, engines.tp, engines, total, 0.0)


def relative_step_time(layout: Layout, activation_checkpointing: bool, gpus_per_node: int = 8) -> float:
    """A rank of speed, 1.0 the fastest possible (module docstring): no seconds, only an order."""
    cross_node = layout.shard_group > gpus_per_node
    return (
        (1 + AC_COST * activation_checkpointing)
        * (1 + TP_COST * math.log2(layout.tp))
        * (1 + CP_COST * math.log2(layout.cp))
        * (1 + CROSS_NODE_FSDP_COST * cross_node)
    )


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    gpus: int
    gpu_memory_gb: float
    workload: Workload
    estimates: list[Estimate]
    choice: Estimate | None
    reason: str
    margin: float = MARGIN
    """The share of every GPU's memory each layout that fits leaves free."""

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GIB * (1 - self.margin)


def plan(
    shape: ModelShape, gpus: int, gpu_memory_gb: float, workload: Workload, gpus_per_node: int = 8,
    checkpointing: tuple[bool, ...] = (False, True), margin: float = MARGIN,
) -> Plan:  # fmt: skip
    """Every candidate layout, without and with activation checkpointing (those of `checkpointing`), and the
    fastest that fits in each GPU's memory less the `margin` (a share of it)."""
    if not 0 <= margin < 1:
        raise ConfigError(f"the margin must be 0% or more and under 100% of a GPU's memory, got {margin:.0%}")
    gpu_bytes = gpu_memory_gb * GIB * (1 - margin)
    estimates = [
        estimate(shape, layout, workload, ac, gpu_bytes, gpus_per_node)
        for layout in candidate_layouts(shape, gpus, gpus_per_node)
        for ac in checkpointing
    ]
    fitting = [e for e in estimates if e.fits(gpu_bytes)]
    if not fitting:
        reason = _nothing_fits(estimates, gpu_memory_gb, margin)
        return Plan(shape, gpus, gpu_memory_gb, workload, estimates, None, reason, margin)

    def speed(e: Estimate):
        time = relative_step_time(e.layout, e.activation_checkpointing, gpus_per_node)
        return time, e.layout.tp, e.layout.cp, max(e.total, e.engine_total)

    choice = min(fitting, key=speed)
    reason = _reason(choice, estimates, gpu_bytes, gpus_per_node)
    return Plan(shape, gpus, gpu_memory_gb, workload, estimates, choice, reason, margin)


def _reason(choice: Estimate, estimates: list[Estimate], gpu_bytes: float, gpus_per_node: int) -> str:
    def speed(e: Estimate) -> float:
        return relative_step_time(e.layout, e.activation_checkpointing, gpus_per_node)

    faster = [e for e in estimates if speed(e) < speed(choice)]
    need = f"needs {max(choice.total, choice.engine_total) / GIB:.1f} of the {gpu_bytes / GIB:.1f} GiB it may use"
    if not faster:
        return f"the fastest layout, and it fits ({need})"
    smallest = min(faster, key=lambda e: e.total)
    checkpointing = "with" if smallest.activation_checkpointing else "without"
    return (
        f"the fastest that fits ({need}); every faster one needs more, the least of them "
        f"{smallest.layout} {checkpointing} activation checkpointing {smallest.total / GIB:.1f} GiB"
    )


def _nothing_fits(estimates: list[Estimate], gpu_memory_gb: float, margin: float) -> str:
    best = min(estimates, key=lambda e: max(e.total, e.engine_total))
    need = max(best.total, best.engine_total) / GIB
    checkpointing = "with" if best.activation_checkpointing else "without"
    return (
        f"no layout fits in {gpu_memory_gb:g} GiB per GPU less the {margin:.0%} margin: "
        f"the smallest ({best.layout} {checkpointing} activation checkpointing) "
        f"needs {need:.1f} GiB; use more GPUs, fewer micro_batch_tokens, LoRA, or CPU offload"
    )


def choose(
    shape: ModelShape, gpus: int, gpu_memory_gb: float, workload: Workload, gpus_per_node: int = 8,
    checkpointing: tuple[bool, ...] = (False, True), margin: float = MARGIN,
) -> tuple[Estimate, str]:  # fmt: skip
    """(the chosen Estimate, why); a one-line ConfigError naming what to change when nothing fits."""
    result = plan(shape, gpus, gpu_memory_gb, workload, gpus_per_node, checkpointing, margin)
    if result.choice is None:
        raise ConfigError(result.reason)
    return result.choice, result.reason


def auto_layout(
    model_config, gpus: int, gpu_memory_gb: float, seq_len: int, activation_checkpointing: bool | None = None,
    gpus_per_node: int = 8, **workload,
) -> dict[str, int]:  # fmt: skip
    """`training.parallel=auto`: the chosen layout of `model_config` (a `ModelConfig`, with its LoRA settings,
    or a name or path) as training.parallel's fields. `activation_checkpointing`: the run's setting, the only
    one considered (None: either; `choose` says which the layout needs). `workload`: `Workload`'s fields."""
    name = getattr(model_config, "name_or_path", model_config)
    lora = getattr(model_config, "lora", None)
    if lora is not None:
        targets = LORA_TARGETS if lora.target_modules == "all-linear" else tuple(lora.target_modules)
        workload = dict(lora_rank=lora.rank, lora_targets=targets) | workload
    checkpointing = (False, True) if activation_checkpointing is None else (activation_checkpointing,)
    chosen, _ = choose(
        model_shape(name), gpus, gpu_memory_gb, Workload(seq_len, **workload), gpus_per_node, checkpointing
    )
    layout = chosen.layout
    ep = dict(ep=layout.ep) if layout.ep > 1 else {}
    return dict(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp, cp=layout.cp) | ep
