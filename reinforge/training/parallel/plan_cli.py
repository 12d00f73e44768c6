"""`reinforge plan`: the layout planner's table (training/parallel/planner.py) for a model, a GPU count and a sequence
length, the chosen layout and why, and the arithmetic of the chosen layout's terms."""

from __future__ import annotations

import argparse
import math

from reinforge.errors import ConfigError
from reinforge.training.parallel.plan_arithmetic import arithmetic
from reinforge.training.parallel.planner import (
    GIB,
    LORA_TARGETS,
    MARGIN,
    Estimate,
    Plan,
    Workload,
    model_shape,
    plan,
)

COLUMNS = ("params", "gathered", "grads", "optimizer", "activations", "logits", "reference")


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    plan_parser = commands.add_parser(
        "plan",
        help="memory per GPU of each parallel layout of a model, and the fastest that fits",
        description="For each candidate layout (dp_replicate x dp_shard x tp x cp), the memory per GPU of weights, "
        "gradients, AdamW state, activations with and without activation checkpointing, logits, the reference "
        "model and the generation engine; then the fastest layout that fits and why (docs/distributed.md, "
        "'The planner'). Loads no model.",
    )
    plan_parser.add_argument("--model", required=True, help="a model directory (config.json) or a built-in name")
    plan_parser.add_argument("--gpus", type=int, required=True, help="training GPUs")
    plan_parser.add_argument("--gpu-memory", type=float, required=True, metavar="GB", help="memory per GPU, GiB")
    plan_parser.add_argument("--seq-len", type=int, required=True, help="longest sequence, prompt + response")
    plan_parser.add_argument("--micro-batch-tokens", type=int, help="tokens per micro-batch (default: --seq-len)")
    plan_parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per machine (default: 8); no tp group spans two"
    )
    plan_parser.add_argument("--lora", type=int, metavar="RANK", help="train LoRA adapters of this rank")
    plan_parser.add_argument(
        "--lora-targets", default="all-linear", help="comma-separated module names, or all-linear (the default)"
    )
    plan_parser.add_argument("--kl", action="store_true", help="a frozen reference model for the KL term")
    plan_parser.add_argument(
        "--generation",
        choices=("colocated", "separate", "none"),
        default="colocated",
        help="where the generation engine runs: on the training GPUs (colocated, the default), on GPUs of its own "
        "(separate), or nowhere (none: SFT, DPO, RM)",
    )
    plan_parser.add_argument("--generation-sequences", type=int, default=16, help="sequences in the KV cache")
    plan_parser.add_argument("--generation-tp", type=int, help="the engine's tensor-parallel size (default: auto)")
    plan_parser.add_argument(
        "--logprob-chunk-tokens",
        type=int,
        default=2048,
        help="tokens whose logits are held at once when logprobs are computed (default: 2048)",
    )
    plan_parser.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="gpu (bf16 compute, fp32 master weights; the default) or cpu (fp32, one process per rank)",
    )
    plan_parser.add_argument("--runtime-gb", type=float, help="fixed overhead per GPU or process, GiB")
    plan_parser.add_argument(
        "--margin",
        type=float,
        default=MARGIN * 100,
        metavar="PERCENT",
        help=f"memory every GPU keeps free, in percent (default: {MARGIN * 100:.0f}); a layout fits within the rest",
    )
    plan_parser.add_argument(
        "--pp-schedule", choices=("1F1B", "GPipe"), default="1F1B", help="the pipeline's schedule (default: 1F1B)"
    )
    plan_parser.add_argument(
        "--pp-microbatches", type=int, help="micro-batches of one pipeline pass (default: 4 per stage)"
    )
    plan_parser.add_argument("--fitting-only", action="store_true", help="list only the layouts that fit")
    plan_parser.set_defaults(run=run_plan_command)


def check_plan_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """Each option's range, one line for the first out of it (argparse checks only types); the LoRA targets."""
    checks = [
        (args.gpus >= 1, f"--gpus {args.gpus}: give the number of training GPUs, 1 or more"),
        (math.isfinite(args.gpu_memory) and args.gpu_memory > 0, f"--gpu-memory {args.gpu_memory:g}: give GiB > 0"),
        (args.seq_len >= 1, f"--seq-len {args.seq_len}: give the longest sequence in tokens, 1 or more"),
        (args.micro_batch_tokens is None or args.micro_batch_tokens >= 1,
         f"--micro-batch-tokens {args.micro_batch_tokens}: give 1 or more (or leave it out: --seq-len)"),
        (args.gpus_per_node >= 1, f"--gpus-per-node {args.gpus_per_node}: give 1 or more"),
        (args.lora is None or args.lora >= 1, f"--lora {args.lora}: give the adapters' rank, 1 or more"),
        (args.generation_sequences >= 1, f"--generation-sequences {args.generation_sequences}: give 1 or more"),
        (args.generation_tp is None or args.generation_tp >= 1,
         f"--generation-tp {args.generation_tp}: give 1 or more (or leave it out: the smallest that fits)"),
        (args.generation_tp is None or args.generation != "none", "--generation-tp needs an engine: --generation "
         "none has none"),
        (args.logprob_chunk_tokens >= 1, f"--logprob-chunk-tokens {args.logprob_chunk_tokens}: give 1 or more"),
        (args.runtime_gb is None or (math.isfinite(args.runtime_gb) and args.runtime_gb >= 0),
         f"--runtime-gb {args.runtime_gb}: give GiB >= 0"),
        (args.lora is not None or args.lora_targets == "all-linear", "--lora-targets needs --lora RANK"),
        (args.pp_microbatches is None or args.pp_microbatches >= 1,
         f"--pp-microbatches {args.pp_microbatches}: give 1 or more (or leave it out: 4 per stage)"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if args.lora_targets == "all-linear":
        return LORA_TARGETS
    targets = tuple(name.strip() for name in args.lora_targets.split(","))
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if unknown or not targets:
        raise ConfigError(
            f"--lora-targets {args.lora_targets}: {', '.join(repr(n) for n in unknown)} is not a linear layer "
            f"the planner knows; choose among {','.join(LORA_TARGETS)}, or all-linear"
        )
    return targets


def run_plan_command(args: argparse.Namespace) -> None:
    targets = check_plan_arguments(args)
    workload = Workload(
        seq_len=args.seq_len,
        micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
        kl=args.kl,
        lora_rank=args.lora,
        lora_targets=targets,
        generation=args.generation,
        generation_sequences=args.generation_sequences,
        generation_tp=args.generation_tp,
        device=args.device,
        runtime_gib=args.runtime_gb,
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
    )
    machine = args.gpus_per_node if args.generation == "separate" else min(args.gpus, args.gpus_per_node)
    if args.generation_tp and args.generation_tp > machine:
        where = "--gpus-per-node" if args.generation == "separate" or args.gpus > args.gpus_per_node else "--gpus"
        raise ConfigError(
            f"--generation-tp {args.generation_tp} exceeds the {machine} GPU(s) one engine can use ({where})"
        )
    result = plan(
        model_shape(args.model), args.gpus, args.gpu_memory, workload, args.gpus_per_node, margin=args.margin / 100
    )
    print(format_plan(args.model, result, args.fitting_only, args.gpus_per_node))


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _engines(e: Estimate) -> str:
    """The engine+kv column: GiB per engine GPU, engines@tensor-parallel size."""
    return f"{_gib(sum(e.engine.values()))} {e.engine_layout.num_engines}@tp{e.engine_tp}" if e.engine else "-"


def _numbers(layout, moe: bool, pipeline: bool) -> tuple[int, ...]:
    """A layout's R x S x T x C column, with pp (P) first when the plan has pipelines, ep (E) for an MoE model."""
    numbers = (layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp)
    return ((layout.pp,) if pipeline else ()) + numbers + ((layout.ep,) if moe else ())


def config_keys(result: Plan, gpus_per_node: int = 8) -> dict[str, object]:
    """The run's settings of the plan's choice, as `key=value` overrides of an RL run (GPU workers, FSDP2)."""
    choice = result.choice
    layout = choice.layout
    keys: dict[str, object] = {
        "training.backend": "fsdp2",
        "training.num_workers": layout.gpus,
        "cluster.num_gpus_per_worker": 1,
        "cluster.gpus_per_node": gpus_per_node,
        "training.activation_checkpointing": str(choice.activation_checkpointing).lower(),
        "training.parallel.dp_replicate": layout.dp_replicate,
        "training.parallel.dp_shard": layout.dp_shard,
        "training.parallel.tp": layout.tp,
        "training.parallel.cp": layout.cp,
    }
    if layout.ep > 1:
        keys["training.parallel.ep"] = layout.ep
    if layout.pp > 1:
        workload = result.workload
        keys |= {
            "training.parallel.pp": layout.pp,
            "training.parallel.pp_schedule": workload.pp_schedule,
            "training.parallel.pp_microbatches": workload.microbatches(layout.pp),
        }
    if result.workload.micro_batch_tokens:
        keys["training.micro_batch_tokens"] = result.workload.micro_batch_tokens
    if choice.engine_layout is not None:
        keys |= {"generation.backend": "vllm", **choice.engine_layout.config_keys()}
    return keys


def format_plan(name: str, result: Plan, fitting_only: bool = False, gpus_per_node: int = 8) -> str:
    """The table (GiB per GPU; activations and totals without / with activation checkpointing), the choice."""
    shape, workload = result.shape, result.workload
    active = f" ({shape.active_parameters():,} active: top-{shape.num_experts_per_tok} of {shape.num_experts} experts)"
    pipeline = any(e.layout.pp > 1 for e in result.estimates)
    header = [
        "layout (" + ("P x " if pipeline else "") + "R x S x T x C" + (" x E)" if shape.moe else ")"),
        *COLUMNS[:4],
        "activations",
        "logits",
        "ref",
        "engine+kv",
        "runtime",
        "total",
        "fits",
    ]
    rows = [header]
    by_layout: dict = {}
    for e in result.estimates:
        by_layout.setdefault(e.layout, {})[e.activation_checkpointing] = e
    for layout, pair in by_layout.items():
        off, on = pair.get(False, pair.get(True)), pair.get(True, pair.get(False))
        fits = [label for label, e in (("no ckpt", off), ("ckpt", on)) if e.fits(result.usable_bytes)]
        if fitting_only and not fits:
            continue
        rows.append(
            [
                "x".join(map(str, _numbers(layout, shape.moe, pipeline))),
                *(_gib(on.terms[c]) for c in COLUMNS[:4]),
                f"{_gib(off.terms['activations'])} / {_gib(on.terms['activations'])}",
                _gib(on.terms["logits"]),
                _gib(on.terms["reference"]),
                _engines(on),
                _gib(on.terms["runtime"]),
                f"{_gib(off.total)} / {_gib(on.total)}",
                ", ".join(fits) or "no",
            ]
        )
    lines = [
        f"{name}: {shape.parameters():,} parameters{active if shape.moe else ''} on {result.gpus} x "
        f"{result.gpu_memory_gb:g} GiB, "
        f"{workload.tokens} tokens per micro-batch, generation {workload.generation}; GiB per GPU, "
        "activations and total without / with activation checkpointing; engine+kv: engines@tensor-parallel size",
        f"margin: {result.margin:.0%} of each GPU kept free, so a layout fits in {result.usable_bytes / GIB:.1f} of "
        f"{result.gpu_memory_gb:g} GiB",
        *_aligned(rows),
    ]
    if result.choice is None:
        return "\n".join([*lines, f"nothing fits: {result.reason}"])
    choice = result.choice
    checkpointing = "on" if choice.activation_checkpointing else "off"
    lines.append(f"choice: {choice.layout}, activation checkpointing {checkpointing}: {result.reason}")
    if choice.engine_layout is not None:
        engines = choice.engine_layout
        where = "on the training GPUs (colocated)" if engines.colocate else "on GPUs of its own (disaggregated)"
        lines.append(f"engines: {engines.num_engines} of tensor-parallel size {engines.tp}, {where}")
    keys = " ".join(f"{key}={value}" for key, value in config_keys(result, gpus_per_node).items())
    lines.append(f"config keys: {keys}")
    return "\n".join([*lines, "arithmetic of the choice:", *arithmetic(shape, workload, choice)])


def _aligned(rows: list[list[str]]) -> list[str]:
    """Rows as lines, each column as wide as its widest cell and two spaces from the next: the first and last
    (layout, fits) left-aligned, the numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1
    aligned = [[cell.ljust(w) if i in (0, last) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
               for row in rows]  # fmt: skip
    return ["  ".join(cells).rstrip() for cells in aligned]
