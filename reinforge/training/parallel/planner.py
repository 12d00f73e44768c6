"""The layout planner (`reinforge plan`, `training.parallel=auto`): memory per GPU of each way to split a model
over N GPUs, and the fastest split that fits.

The layouts, the workload and the speed ranking are plan_layouts.py's: `Layout(dp_replicate, dp_shard, tp, cp,
ep, pp)` as training/parallel/ runs it. Within a pipeline stage FSDP2 shards the weights, gradients and AdamW
state over dp_shard x cp x tp ranks (cp ranks shard like data-parallel ones, tp ranks hold a 1/tp slice of every
matrix and of the vocabulary) and replicates them over dp_replicate (HSDP).

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
  values repeated to every head, its output and o_proj's input, 5 Q b, and an fp32 log-sum-exp per head (Qwen3's
  query and key norms over each head keep (Q + kv width) (4 + 2b) more, as the RMSNorms do); the
  SwiGLU MLP keeps gate, silu(gate), up and their product, 4 I b. Sequence parallelism shards all of it over
  tp (Korthikanti et al. 2022) but the attention's and the MLP's inputs, all-gathered and kept whole by their
  column-wise linear layers: 2 H b (tp - 1) / tp more. No attention-score term (flash/efficient attention), but
  the packed segment attention's mask (`attention_mask_bytes`): [N, 1, s, s] per layer, which sdpa converts to
  the compute dtype and keeps, micro_batch_tokens x seq_len x b, not divided by tp or cp (measured at 2K-token
  sequences: bench/plan_memory.py). Without activation checkpointing L x that; with it, each layer's input only
  (L x T x H x b / tp) plus one layer recomputed;
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
- runtime: a fixed overhead, reported apart from the model's terms: `GPU_RUNTIME_GIB` on GPU (CUDA context,
  NCCL buffers, the caching allocator's fragmentation: estimated, not measured here; bench/gpu_checks.sh
  measures it where a GPU is lent), `CPU_PROCESS_GIB` on CPU (a process that imported torch, transformers
  and reinforge's training backend, measured by bench/plan_memory.py in every rank).

Pipeline parallelism (pp stages; `stage_layer_counts`: contiguous runs of layers, the earlier stages taking the
extra one): each stage's GPUs hold the terms above for the stage's layers only, the embedding on the first
stage, the final norm and the LM head (and the logits) on the last (`stage_parameters`; a tied head is a copy
of its own there), and the activations of the micro-batches in flight: 1F1B holds min(m, pp - s) micro-batches
on stage s (the first stage runs pp forwards before its first backward), GPipe all m. torch.distributed.pipelining's
`PipelineStage` allocates a receive buffer for every micro-batch of a pass, held for the stage's life: m x T H b / tp
for the activations (every stage but the first) and as much for their gradients (every stage but the last),
counted with the activations. The worst stage counts
(`Estimate.stage`): the first under 1F1B (most micro-batches in flight, the embedding), or the last (the LM
head and the logits) when its vocabulary outweighs them.

A layout fits when every GPU keeps the safety margin (`MARGIN`, `reinforge plan --margin`, 10% of its memory by
default) free: the terms are estimates, and a GPU filled to the last estimated byte fails on the first larger
allocation. Validated against measured peaks: docs/benchmarks.md ("Planner") and docs/distributed.md ("The planner").

Mixture-of-experts models (model_shape.py; expert.py): the experts' P_e = L x E x 3 H I_moe parameters are
split over ep ranks by expert, over tp by each expert's intermediate dimension (tensor_plan.py), and
FSDP2-sharded over the other dp_shard x cp / ep: S ranks in all, as the dense part. ep is the largest that
divides dp_shard x cp and E (it adds no rank; FSDP2 then gathers only a rank's E / ep experts, each 1/tp of
it: the gathered term counts E / (ep x tp) experts per layer). Activations follow the active parameters: a
token's top_k routed copies each keep the expert's gate, silu(gate), up, their product (4 I_moe b: the [gate;
up] output is gathered whole over tp before the activation), the token's hidden and the expert's output before
its routing weight (2 H b), not divided by tp, and an fp32 router logit per expert (measured on the MoE demo:
bench/plan_memory.py). `reinforge plan` prints both counts, total and active (a token's: top_k /
E of the experts).

Speed: plan_layouts.py's `relative_step_time` ranks the layouts that fit (rules of thumb, the pipeline's bubble
and the network's share of a micro-batch); it predicts no seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reinforge.errors import ConfigError
from reinforge.training.parallel.engine_layout import EngineLayout, engine_candidates
from reinforge.training.parallel.model_shape import (  # noqa: F401  (re-exported: the planner's API)
    KNOWN_MODELS,
    LORA_TARGETS,
    ModelShape,
    model_shape,
    shape_of_config,
)
from reinforge.training.parallel.plan_layouts import (  # noqa: F401  (re-exported: the planner's API)
    Layout,
    Workload,
    bubble,
    candidate_layouts,
    relative_step_time,
    stage_layer_counts,
    stage_parameters,
)

GIB = 2**30
MARGIN = 0.10  # the share of every GPU's memory a layout leaves free (module docstring)
GPU_RUNTIME_GIB = 3.0
CPU_PROCESS_GIB = 0.42  # bench/plan_memory.py: peak RSS of a process that imported torch + transformers + backend


def activation_bytes_per_token(shape: ModelShape, element_bytes: int) -> float:
    """Bytes autograd keeps per token in one decoder layer (module docstring): two RMSNorms, attention, the dense
    MLP (an MoE layer's experts: `expert_activation_bytes_per_token`)."""
    b, q = element_bytes, shape.num_attention_heads * shape.head_size
    norms = 2 * shape.hidden_size * (4 + 2 * b)
    norms += (q + shape.kv_width) * (4 + 2 * b) if shape.qk_norm else 0  # Qwen3's per-head query and key norms
    attention = 5 * q * b + 4 * shape.num_attention_heads
    return norms + attention + (0 if shape.moe else 4 * shape.intermediate_size * b)


def attention_mask_bytes(workload: Workload) -> float:
    """One layer's [N, 1, s, s] mask of the packed segment attention (training/segment_attention.py), which sdpa
    converts to the compute dtype and keeps for its backward: the micro-batch's tokens x the sequence length x b,
    whole on every tp and cp rank (each attends over all positions of its heads)."""
    return workload.tokens * min(workload.seq_len, workload.tokens) * workload.element_bytes


def expert_activation_bytes_per_token(shape: ModelShape, element_bytes: int) -> float:
    """Bytes an MoE layer keeps per token for its experts (module docstring), not sliced by tp; 0 when dense."""
    if not shape.moe:
        return 0.0
    slot = 4 * shape.moe_intermediate_size * element_bytes + 2 * shape.hidden_size * element_bytes
    return shape.num_experts_per_tok * slot + 4 * shape.num_experts


def engine_terms(shape: ModelShape, workload: Workload, engine_tp: int) -> dict[str, float]:
    kv_heads = max(shape.num_key_value_heads // engine_tp, 1)  # vLLM replicates kv heads when tp exceeds them
    kv_tokens = workload.generation_sequences * workload.seq_len
    return {
        "engine weights": 2 * shape.parameters() / engine_tp,
        "kv cache": shape.num_hidden_layers * 2 * kv_heads * shape.head_size * kv_tokens * 2,
    }


def memory_terms(
    shape: ModelShape, layout: Layout, workload: Workload, activation_checkpointing: bool, stage: int = 0
) -> dict[str, float]:
    """Bytes per GPU of pipeline stage `stage`'s training phase, term by term (module docstring); no engine."""
    b, tp, group, pp = workload.element_bytes, layout.tp, layout.shard_group, layout.pp
    layers = stage_layer_counts(shape.num_hidden_layers, pp)[stage]
    lora = workload.lora_rank is not None
    adapters = shape.lora_parameters(workload.lora_rank, workload.lora_targets) if lora else 0
    adapters = adapters * layers // shape.num_hidden_layers
    held = workload.held_microbatches(pp, stage)
    stage_params = stage_parameters(shape, pp, stage)
    weights = (stage_params + adapters) / group  # the experts too: over ep x tp, FSDP2 over dp_shard x cp / ep
    trained = adapters / group if lora else weights
    gathered = 0.0
    if b < 4 or layout.dp_shard * layout.cp > 1:
        experts = shape.expert_parameters()
        layer = (shape.layer_parameters() - experts) / tp + experts / (layout.ep * tp)
        root = (stage_params - layers * shape.layer_parameters()) / tp
        prefetched = min(layers, 2) * layer
        gathered = b * (prefetched + root + (0 if lora else layer + root))
    tokens = workload.tokens / layout.cp
    gathered_inputs = 2 * shape.hidden_size * b * (tp - 1) / tp  # attention's and the MLP's all-gathered input
    per_token = (
        activation_bytes_per_token(shape, b) / tp + gathered_inputs + expert_activation_bytes_per_token(shape, b)
    )
    per_layer = tokens * per_token + attention_mask_bytes(workload)
    inputs = held * layers * tokens * shape.hidden_size * b / tp
    received = (stage > 0) + (stage < pp - 1) if pp > 1 else 0  # activations from before, gradients from after
    boundary = received * workload.microbatches(pp) * tokens * shape.hidden_size * b / tp
    activations = inputs + per_layer if activation_checkpointing else held * layers * per_layer
    last = stage == pp - 1
    chunk = min(workload.logprob_chunk_tokens, tokens)
    head = chunk * math.ceil(shape.vocab_size / tp) * (b + 12) + held * tokens * shape.hidden_size * (4 + 3 * b) / tp
    runtime = workload.runtime_gib
    if runtime is None:
        runtime = GPU_RUNTIME_GIB if workload.device == "gpu" else CPU_PROCESS_GIB
    return {
        "params": 4 * weights,
        "gathered": gathered,
        "grads": 4 * trained,
        "optimizer": 8 * trained,
        "activations": activations + boundary,
        "logits": head if last else 0.0,
        "reference": 4 * stage_params / group if workload.kl and not lora else 0.0,
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
    stage: int = 0
    """The pipeline stage whose GPUs need the most (`terms` and `total` are its)."""

    def fits(self, gpu_bytes: float) -> bool:
        return self.total <= gpu_bytes and self.engine_total <= gpu_bytes


def estimate(
    shape: ModelShape, layout: Layout, workload: Workload, activation_checkpointing: bool, gpu_bytes: float,
    gpus_per_node: int = 8,
) -> Estimate:  # fmt: skip
    """The memory of `layout`'s GPUs: each pipeline stage's terms, the engines, and the stage that needs the most."""
    stages = [memory_terms(shape, layout, workload, activation_checkpointing, s) for s in range(layout.pp)]
    if workload.generation == "none":
        stage = max(range(layout.pp), key=lambda s: sum(stages[s].values()))
        terms = stages[stage]
        return Estimate(layout, activation_checkpointing, terms, {}, 0, None, sum(terms.values()), 0.0, stage)
    persistent = [sum(terms[name] for name in PERSISTENT) for terms in stages]
    resident = stages[0]["runtime"] if workload.generation == "separate" else max(persistent)  # beside the engine
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
        stage = max(range(layout.pp), key=lambda s: sum(stages[s].values()))
        return Estimate(
            layout, activation_checkpointing, stages[stage], engine, engines.tp, engines,
            sum(stages[stage].values()), resident + sum(engine.values()), stage,
        )  # fmt: skip
    totals = [max(sum(terms.values()), persistent[s] + sum(engine.values())) for s, terms in enumerate(stages)]
    stage = max(range(layout.pp), key=totals.__getitem__)
    return Estimate(
        layout, activation_checkpointing, stages[stage], engine, engines.tp, engines, totals[stage], 0.0, stage
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
        time = relative_step_time(e.layout, e.activation_checkpointing, gpus_per_node, shape, workload)
        return time, e.layout.tp, e.layout.cp, e.layout.pp, max(e.total, e.engine_total)

    choice = min(fitting, key=speed)
    reason = _reason(choice, estimates, gpu_bytes, gpus_per_node, shape, workload)
    return Plan(shape, gpus, gpu_memory_gb, workload, estimates, choice, reason, margin)


def _reason(
    choice: Estimate, estimates: list[Estimate], gpu_bytes: float, gpus_per_node: int, shape: ModelShape,
    workload: Workload,
) -> str:  # fmt: skip
    def speed(e: Estimate) -> float:
        return relative_step_time(e.layout, e.activation_checkpointing, gpus_per_node, shape, workload)

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
    start = f"no layout fits in {gpu_memory_gb:g} GiB per GPU less the {margin:.0%} margin: "
    engine = sum(best.engine.values()) + best.terms["runtime"]
    if best.engine and engine > gpu_memory_gb * GIB * (1 - margin):  # more training GPUs would not help
        return (
            f"{start}the generation engine alone needs {engine / GIB:.1f} GiB per GPU at tensor-parallel size "
            f"{best.engine_tp} (an engine spans one node at most); plan it with --generation none (SFT, DPO, RM) "
            "or give the engine GPUs of more memory"
        )
    return (
        f"{start}the smallest ({best.layout} {checkpointing} activation checkpointing) "
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
    return chosen.layout.fields()
