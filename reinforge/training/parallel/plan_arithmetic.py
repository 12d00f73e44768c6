"""`reinforge plan`'s arithmetic of a layout: each memory term of its worst pipeline stage as planner.py's formula
with the numbers in, the pipeline's stage and bubble, the engine and the phase that counts."""

from __future__ import annotations

import math

from reinforge.training.parallel.plan_layouts import Workload, bubble, stage_layer_counts, stage_parameters
from reinforge.training.parallel.planner import (
    GIB,
    PERSISTENT,
    Estimate,
    ModelShape,
    activation_bytes_per_token,
    expert_activation_bytes_per_token,
)


def gib_unit(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def _stage_line(shape: ModelShape, workload: Workload, e: Estimate, layers: int, held: int) -> list[str]:
    """The worst stage (what it holds) and the bubble; nothing without pp."""
    pp, s = e.layout.pp, e.stage
    if pp == 1:
        return []
    parts = [f"{layers} layers"] + ["the embedding"] * (s == 0) + ["the final norm and LM head"] * (s == pp - 1)
    m = workload.microbatches(pp)
    rule = f"min(m {m}, pp {pp} - stage {s})" if workload.pp_schedule == "1F1B" else f"GPipe: all m {m}"
    return [
        f"  stage       = {s} of {pp} (the one that needs the most): {', '.join(parts)}; "
        f"{held} micro-batch(es) held ({workload.pp_schedule}: {rule})",
        f"  bubble      = (pp {pp} - 1) / (m {m} + pp {pp} - 1) = {bubble(pp, m):.1%} of each pass idle",
    ]


def arithmetic(shape: ModelShape, workload: Workload, e: Estimate) -> list[str]:
    """Each term of `e` (its worst stage) as the formula of training/parallel/planner.py with the numbers in."""
    layout, b, t = e.layout, workload.element_bytes, e.terms
    group, tp, tokens = layout.shard_group, layout.tp, workload.tokens / layout.cp
    layers = stage_layer_counts(shape.num_hidden_layers, layout.pp)[e.stage]
    held = workload.held_microbatches(layout.pp, e.stage)
    params, lora = stage_parameters(shape, layout.pp, e.stage), workload.lora_rank
    adapters = shape.lora_parameters(lora, workload.lora_targets) * layers // shape.num_hidden_layers if lora else 0
    experts = layers * shape.expert_parameters()
    weights = f"({params - experts + adapters:,} + experts {experts:,}) / {group}" if shape.moe else None
    weights = weights or f"{params + adapters:,} / {group}"
    trained = f"{adapters:,} / {group}" if lora else weights
    per_token = activation_bytes_per_token(shape, b)
    per_layer = f"{per_token:,.0f} B / tp {tp}"
    if tp > 1:
        per_layer += f" + gathered inputs {2 * shape.hidden_size * b * (tp - 1) / tp:,.0f} B"
    if shape.moe:
        per_layer += f" + {expert_activation_bytes_per_token(shape, b):,.0f} B (experts)"
    mask = f"mask {workload.tokens} x {min(workload.seq_len, workload.tokens)} x {b} B"
    per_layer = f"({tokens:g} tokens x ({per_layer}) + {mask})"
    chunk, vocab = min(workload.logprob_chunk_tokens, tokens), math.ceil(shape.vocab_size / tp)
    layer = f"{shape.layer_parameters() - shape.expert_parameters():,} / tp {tp}"
    if shape.moe:
        layer = f"({layer} + experts {shape.expert_parameters():,} / (ep {layout.ep} x tp {tp}))"
    root = f"{params - layers * shape.layer_parameters():,} / tp {tp}"
    gathered = f"({min(layers, 2)} x {layer} + {root} + gradients {0 if lora else f'{layer} + {root}'})"
    times = f"{held} micro-batch(es) x " if layout.pp > 1 else ""
    if e.activation_checkpointing:
        activations = (
            f"{times}{layers} layers x {tokens:g} tokens x {shape.hidden_size} x {b} B / tp {tp} "
            f"+ {per_layer} (one layer recomputed)"
        )
    else:
        activations = f"{times}{layers} layers x {per_layer}"
    received = (e.stage > 0) + (e.stage < layout.pp - 1)
    if layout.pp > 1:
        m = workload.microbatches(layout.pp)
        activations += f" + receive buffers {received} x m {m} x {tokens:g} x {shape.hidden_size} x {b} B / tp {tp}"
    logits = "0 (not the last stage)"
    if e.stage == layout.pp - 1:
        logits = (
            f"{chunk:g} x {vocab:,} x ({b} + 12) B + {times}{tokens:g} x {shape.hidden_size} x {4 + 3 * b} B / tp {tp}"
        )
    lines = [
        *_stage_line(shape, workload, e, layers, held),
        f"  params      = 4 B x {weights} = {gib_unit(t['params'])}",
        f"  gathered    = {b} B x {gathered} = {gib_unit(t['gathered'])}",
        f"  grads       = 4 B x {trained} = {gib_unit(t['grads'])}",
        f"  optimizer   = 8 B x {trained} = {gib_unit(t['optimizer'])}",
        f"  activations = {activations} = {gib_unit(t['activations'])}",
        f"  logits      = {logits} = {gib_unit(t['logits'])}",
        f"  reference   = {gib_unit(t['reference'])}; runtime (apart from the model's terms) = "
        f"{gib_unit(t['runtime'])}",
    ]
    if e.engine:
        kv_heads = max(shape.num_key_value_heads // e.engine_tp, 1)
        lines += [
            f"  engine      = 2 B x {shape.parameters():,} / tp {e.engine_tp} = {gib_unit(e.engine['engine weights'])}",
            f"  kv cache    = {shape.num_hidden_layers} x 2 x {kv_heads} x {shape.head_size} x "
            f"{workload.generation_sequences} x {workload.seq_len} x 2 B = {gib_unit(e.engine['kv cache'])}",
        ]
    training = sum(t.values())
    if workload.generation == "colocated":
        generation = sum(t[name] for name in PERSISTENT) + sum(e.engine.values())
        lines.append(
            f"  training phase {gib_unit(training)}; generation phase (params, optimizer, reference, "
            f"runtime, engine, kv cache) {gib_unit(generation)}; the larger: {gib_unit(e.total)}"
        )
    else:
        lines.append(f"  training phase {gib_unit(training)}")
    return lines
