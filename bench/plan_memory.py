"""The planner's memory prediction (reinforge/training/parallel/planner.py, device "cpu") against the measured peak
of real training steps on this machine, per rank, for each layout of `--layouts`.

    python bench/plan_memory.py                                      # LAYOUTS: each model in one process,
                                                                     # dp_shard 2, tp 2, cp 2
    python bench/plan_memory.py --layouts 30m:local 30m:2x1x1x1      # any entries: a layout dp_replicate x
                                                                     # dp_shard x tp x cp (the product: ranks)
    python bench/plan_memory.py --layouts $(python bench/plan_memory.py --print-rows long)  # LONG_ROWS

An entry is MODEL:local (the one-process backend, `LocalStrategy`) or MODEL:RxSxTxC (that many FSDP2 ranks with
`training.parallel` = dp_replicate R, dp_shard S, tp T, cp C, over gloo), optionally followed by `,epN` (expert
parallelism), `,ppN` (N pipeline stages, outermost: N times the ranks) and `@TOKENS` (sequences of TOKENS tokens,
a quarter prompt, `LONG_TOKENS_PER_RANK` tokens per data-parallel rank: `30m:1x1x2x1@2048`); MODEL `demo`
(models/demo), `moe` (models/moe_demo, 8 experts, top-2) or `30m` (a ~30M Qwen2 with random weights,
`_common.build_30m_model`, built in a temporary directory). Every rank is a
fresh process (torch.multiprocessing spawn, one torch thread, glibc's mmap threshold fixed at 64 KiB as in
bench/lora_memory.py, so that freed tensors do not stay in the heap by chance) that builds the backend, computes
the batch's logprobs and takes `--steps` training steps (GRPO's clipped loss, no KL) on a GRPO-shaped batch:
`SEQUENCES_PER_RANK` sequences of 30-42 prompt and 48 response tokens per data-parallel rank, packed in
micro-batches of `MICRO_BATCH_TOKENS`, so every rank runs the same micro-batches as one process does. Its peak is
the kernel's high-water mark of its resident memory (VmHWM in /proc/self/status): unlike getrusage's ru_maxrss
(reinforge/logging/memory.py) it starts afresh at the exec of a spawned process, so a rank does not report the
parent's peak. The process baseline, which the planner adds as its runtime term, is measured the same way in each
rank once it has imported torch, transformers and the training backend, before it loads anything; each row reports
it apart, and the model's terms (the peak less the baseline against the prediction less its runtime term) beside
the whole. With pipeline stages each rank is compared with its own stage's prediction (rank // (ranks / pp)).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
LAYOUTS = tuple(
    f"{model}:{layout}" for model in ("demo", "30m") for layout in ("local", "1x2x1x1", "1x1x2x1", "1x1x1x2")
)
# the issue-45 rows: 2K-token sequences in one process, at tp 2 and cp 2; the MoE demo in one process, at ep 2 and
# at tp 2 x ep 2 (4 ranks); the pipeline's rows (pp 2 alone and with tp 2) once training.parallel.pp runs
LONG_ROWS = (
    "30m:local@2048",
    "30m:1x1x2x1@2048",
    "30m:1x1x1x2@2048",
    "moe:local",
    "moe:1x2x1x1,ep2",
    "moe:1x2x2x1,ep2",
)
PIPELINE_ROWS = ("30m:1x1x1x1,pp2@2048", "30m:1x1x2x1,pp2@2048", "moe:1x2x1x1,ep2,pp2")
SEQUENCES_PER_RANK, PROMPT, RESPONSE, MICRO_BATCH_TOKENS = 64, (30, 42), (48, 48), 4096
LONG_TOKENS_PER_RANK = 4096
TOLERANCE = 0.15


def peak_rss_gib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20


def parse_layout(text: str):
    """(model, Layout or None for the one-process backend, sequence tokens or None for the short GRPO rows)."""
    from reinforge.training.parallel.planner import Layout

    model, _, rest = text.partition(":")
    rest, _, tokens = rest.partition("@")
    layout, *options = rest.split(",")
    extra = {option[:2]: int(option[2:]) for option in options}  # ep, pp
    if layout == "local":
        return model, None, int(tokens) if tokens else None
    return model, Layout(*(int(part) for part in layout.split("x")), **extra), int(tokens) if tokens else None


def batch_shape(tokens: int | None) -> tuple[int, tuple[int, int], tuple[int, int], int]:
    """(sequences per data-parallel rank, prompt and response token ranges, micro-batch tokens) of a row."""
    if tokens is None:
        return SEQUENCES_PER_RANK, PROMPT, RESPONSE, MICRO_BATCH_TOKENS
    prompt = tokens // 4
    return LONG_TOKENS_PER_RANK // tokens, (prompt, prompt), (tokens - prompt, tokens - prompt), max(4096, tokens)


def run_rank(rank: int, world_size: int, port: int, model_dir: Path, out_dir: Path, entry: str, steps: int) -> None:
    """One rank: the backend, a logprob pass, `steps` training steps; its peak memory to out_dir/rank{rank}."""
    import torch
    from _common import clipped_token_mean_loss, grpo_like_batch

    from reinforge.model_config import ModelConfig
    from reinforge.training.backend import Backend
    from reinforge.training.base import TrainingConfig
    from reinforge.training.fsdp2 import FSDP2Strategy
    from reinforge.training.heads import LogprobHead
    from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

    baseline = peak_rss_gib()  # torch, transformers and the backend imported, nothing loaded
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, layout, tokens = parse_layout(entry)
    per_rank, prompt, response, micro_batch_tokens = batch_shape(tokens)
    data_parallel = 1 if layout is None else layout.dp_replicate * layout.dp_shard
    sequences = per_rank * data_parallel
    parallel = {}
    if layout is not None:
        from reinforge.training.parallel.layout import ParallelConfig

        parallel = dict(parallel=ParallelConfig(**layout.fields()))
    training = TrainingConfig(
        backend="torch" if layout is None else "fsdp2",
        num_workers=world_size,
        global_batch_size=sequences,
        micro_batch_size=sequences,
        micro_batch_tokens=micro_batch_tokens,
        **parallel,
    )
    backend = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        training,
        OptimizerConfig(lr=1e-5),
        SchedulerConfig(),
        steps,
        head=LogprobHead(temperature=1.0),
        strategy=None if layout is None else FSDP2Strategy(rank, world_size, "127.0.0.1", port),
    )
    batch = grpo_like_batch(sequences, prompt, response, backend.model.config.vocab_size)
    batch.old_logprobs = backend.logprobs(batch)
    for _ in range(steps):
        backend.train_step(batch, clipped_token_mean_loss)
    (out_dir / f"rank{rank}").write_text(json.dumps([baseline, peak_rss_gib()]))
    if layout is not None:
        backend.shutdown()


def spawn(world_size: int, target, args: tuple, timeout_s: float = 900) -> None:
    """`target(rank, world_size, port, *args)` in `world_size` fresh processes; raise if one fails."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    processes = [context.Process(target=target, args=(rank, world_size, port, *args)) for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0))
        if process.is_alive():
            process.kill()
    codes = [process.exitcode for process in processes]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"ranks exited with {codes}")


def prediction(model_dir: Path, layout, tokens: int | None, baseline_gib: float, stage: int = 0) -> dict[str, float]:
    """The planner's terms (GiB) for a rank's (its pipeline stage's) training phase on CPU, with the measured process
    baseline as the runtime term."""
    from reinforge.training.parallel.planner import GIB, Layout, Workload, memory_terms, model_shape

    _, prompt, response, micro_batch_tokens = batch_shape(tokens)
    workload = Workload(
        seq_len=prompt[1] + response[1],
        micro_batch_tokens=micro_batch_tokens,
        device="cpu",
        generation="none",
        runtime_gib=baseline_gib,
    )
    terms = memory_terms(model_shape(str(model_dir)), layout or Layout(1, 1, 1, 1), workload, False, stage)
    return {name: value / GIB for name, value in terms.items()}


def measure(entry: str, models: dict[str, Path], tmp: Path, steps: int) -> dict:
    """One row: its ranks run, each one's peak against its stage's prediction, whole and less the runtime term."""
    from _common import build_30m_model

    model, layout, tokens = parse_layout(entry)
    if model == "30m" and not models["30m"].exists():
        build_30m_model(models["30m"])
    world_size = 1 if layout is None else layout.gpus
    out_dir = tmp / entry.replace(":", "_").replace(",", "_").replace("@", "_")
    out_dir.mkdir()
    start = time.perf_counter()
    spawn(world_size, run_rank, (models[model], out_dir, entry, steps))
    ranks = [json.loads((out_dir / f"rank{rank}").read_text()) for rank in range(world_size)]
    baselines, measured = zip(*ranks)
    baseline = max(baselines)
    per_stage = world_size // (layout.pp if layout else 1)
    stages = [prediction(models[model], layout, tokens, baseline, rank // per_stage) for rank in range(world_size)]
    predicted = [sum(terms.values()) for terms in stages]
    errors = [p / peak - 1 for p, peak in zip(predicted, measured)]
    model_errors = [(p - baseline) / (peak - baseline) - 1 for p, peak in zip(predicted, measured)]
    result = dict(
        ranks=world_size,
        baseline_gib=baselines,
        measured_peak_gib=measured,
        predicted_gib=max(predicted),
        predicted_per_rank_gib=predicted,
        relative_error=errors,
        model_terms_relative_error=model_errors,
        within_tolerance=all(abs(error) <= TOLERANCE for error in errors),
        predicted_terms_gib=stages[0],
        seconds=time.perf_counter() - start,
    )
    print(
        f"{entry:<22} baseline {baseline:.3f} GiB  measured {', '.join(f'{m:.3f}' for m in measured)} GiB  "
        f"predicted {', '.join(sorted({f'{p:.3f}' for p in predicted}))} GiB  "
        f"error {', '.join(f'{e:+.1%}' for e in errors)}  model's terms {', '.join(f'{e:+.1%}' for e in model_errors)}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="MODEL:local or MODEL:RxSxTxC entries")
    parser.add_argument("--steps", type=int, default=2, help="training steps per rank (the first allocates AdamW)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "plan_memory.json")
    parser.add_argument("--print-rows", choices=("long", "pipeline"), help="print LONG_ROWS or PIPELINE_ROWS, exit")
    args = parser.parse_args()
    if args.print_rows:
        print(" ".join(LONG_ROWS if args.print_rows == "long" else PIPELINE_ROWS))
        return
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc when each spawned rank starts
    from _common import write_result

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {"demo": ROOT / "models" / "demo", "moe": ROOT / "models" / "moe_demo", "30m": tmp / "30m"}
        for entry in args.layouts:  # the file rewritten after each row: a long run stopped keeps what it measured
            results[entry] = measure(entry, models, tmp, args.steps)
            write_result(
                args.json,
                dict(
                    date=time.strftime("%Y-%m-%d"),
                    load_average=list(os.getloadavg()),
                    sequences_per_rank=SEQUENCES_PER_RANK,
                    prompt_tokens=PROMPT,
                    response_tokens=RESPONSE,
                    micro_batch_tokens=MICRO_BATCH_TOKENS,
                    long_tokens_per_rank=LONG_TOKENS_PER_RANK,
                    steps=args.steps,
                    tolerance=TOLERANCE,
                    layouts=results,
                ),
            )


if __name__ == "__main__":
    main()
