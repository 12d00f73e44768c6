"""GPU: the same model at pp=1 and pp=2 (training.parallel.pp), each at its largest fitting batch, and one
long-context run: step time, tokens/s, MFU, peak memory against the planner's prediction, and the runtime term
measured apart (the CUDA context and NCCL before anything loads, the caching allocator's reserve beyond its peak).

    python bench/pipeline_mfu.py --pp 1 --json /tmp/pp1.json      # one GPU
    python bench/pipeline_mfu.py --pp 2 --json /tmp/pp2.json      # two GPUs: one rank (stage) each, NCCL
    python bench/pipeline_mfu.py --pp 1 --long-context --json /tmp/long.json
    python bench/pipeline_mfu.py --tiny --pp 2                    # a tiny model on CPU ranks (gloo): checks it runs

The model is Qwen2.5-1.5B's architecture (random weights, bf16 compute, fp32 master weights and AdamW), the batch
GRPO-shaped (128 sequences of 128-384 prompt and 256-1024 response tokens, packed), no activation checkpointing.
"Largest fitting batch": the largest power-of-two `training.micro_batch_tokens` (4K to 64K) for which the planner
(training/parallel/planner.py, `--generation none`, its 10% margin) says every stage fits the GPU; the pipeline runs
`pp_microbatches` = the micro-batches of the batch (at least 2 pp). MFU = the step's model FLOPs
(`_common.training_flops`) / step time / (GPUs x --peak-tflops). `--long-context`: 4 sequences of 32K tokens (8K
prompt), one micro-batch each, activation checkpointing on. NCCL gives no two ranks one GPU: pp=2 needs 2 GPUs.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import QWEN25_1_5B, clipped_token_mean_loss, grpo_like_batch, training_flops, write_result  # noqa: E402
from gpu_training_mfu import TINY, build_model  # noqa: E402

GIB = 2**30


def largest_fitting_tokens(model_dir: Path, pp: int, gpu_gib: float, seq_len: int) -> int:
    """The largest power-of-two micro-batch (4K-64K tokens) of sequences of at most `seq_len` tokens that the planner
    fits in every stage of a pp-stage layout without activation checkpointing."""
    from reinforge.training.parallel.planner import Layout, Workload, estimate, model_shape

    shape, best = model_shape(str(model_dir)), 4096
    for tokens in (4096, 8192, 16384, 32768, 65536):
        workload = Workload(seq_len, micro_batch_tokens=tokens, generation="none", pp_microbatches=2 * pp)
        if estimate(shape, Layout(1, 1, 1, 1, pp=pp), workload, False, 1e18).total <= 0.9 * gpu_gib * GIB:
            best = tokens
    return best


def run_rank(rank: int, world: int, port: int, model_dir: Path, args, out: Path) -> None:
    """One stage: the backend, 2 warm-up steps, `args.steps` timed ones; its numbers to out/rank{rank}.json."""
    from reinforge.model_config import ModelConfig
    from reinforge.training.backend import Backend
    from reinforge.training.base import TrainingConfig
    from reinforge.training.fsdp2 import FSDP2Strategy
    from reinforge.training.heads import LogprobHead
    from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
    from reinforge.training.parallel.layout import ParallelConfig

    on_gpu = torch.cuda.is_available() and not args.tiny
    if on_gpu:
        torch.cuda.set_device(rank)
    strategy = FSDP2Strategy(rank, world, "127.0.0.1", port)
    context_gib = (lambda free, total: (total - free) / GIB)(*torch.cuda.mem_get_info()) if on_gpu else None
    sequences, prompt, response = args.shape
    parallel = ParallelConfig(pp=args.pp, pp_microbatches=args.microbatches) if args.pp > 1 else ParallelConfig()
    training = TrainingConfig(
        backend="fsdp2", num_workers=world, global_batch_size=sequences, micro_batch_size=sequences,
        micro_batch_tokens=args.tokens, activation_checkpointing=args.long_context, parallel=parallel,
    )  # fmt: skip
    dtype = "bfloat16" if on_gpu else "float32"
    backend = Backend(
        ModelConfig(name_or_path=str(model_dir), dtype=dtype), training, OptimizerConfig(lr=1e-6), SchedulerConfig(),
        args.steps + 2, head=LogprobHead(temperature=1.0), strategy=strategy,
    )  # fmt: skip
    batch = grpo_like_batch(sequences, prompt, response, backend.model.config.vocab_size)
    batch.old_logprobs = backend.logprobs(batch)
    for _ in range(2):
        backend.train_step(batch, clipped_token_mean_loss)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        backend.train_step(batch, clipped_token_mean_loss)
        if on_gpu:
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / GIB if on_gpu else None
    slack = torch.cuda.memory_reserved() / GIB - peak if on_gpu else None
    result = dict(steps_s=steps, peak_allocated_gib=peak, context_gib=context_gib, allocator_slack_gib=slack)
    result |= dict(flops=training_flops(backend.model.config, batch), tokens=int(batch.attention_mask.sum()))
    result["predicted_gib"] = predicted_gib(model_dir, args, rank) if on_gpu else None
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    backend.shutdown()


def predicted_gib(model_dir: Path, args, stage: int) -> float:
    """The planner's training-phase memory of `stage` without its runtime term (max_memory_allocated has none)."""
    from reinforge.training.parallel.planner import Layout, Workload, memory_terms, model_shape

    workload = Workload(
        args.shape[1][1] + args.shape[2][1], micro_batch_tokens=args.tokens, generation="none", runtime_gib=0.0,
        pp_microbatches=args.microbatches if args.pp > 1 else None,
    )  # fmt: skip
    layout = Layout(1, 1, 1, 1, pp=args.pp)
    return sum(memory_terms(model_shape(str(model_dir)), layout, workload, args.long_context, stage).values()) / GIB


def math_ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages, one GPU (rank) each")
    parser.add_argument("--long-context", action="store_true", help="4 sequences of 32K tokens, checkpointed")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on CPU ranks (gloo)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="one GPU's dense bf16 peak (H100/H200: 989)")
    parser.add_argument("--json", type=Path, default=Path("/tmp/pipeline_mfu.json"))
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.tiny
    if not on_gpu and not args.tiny:
        print("no CUDA GPU here: nothing measured (--tiny runs a tiny model on CPU ranks through the same code)")
        return
    if on_gpu and torch.cuda.device_count() < args.pp:
        print(f"pp={args.pp}: {torch.cuda.device_count()} GPU(s); NCCL gives each stage a GPU of its own, skipped")
        return
    args.shape = (
        (8, (4, 12), (8, 24)) if args.tiny else (4, (8192, 8192), (24576, 24576)) if args.long_context
        else (128, (128, 384), (256, 1024))
    )  # fmt: skip
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if on_gpu else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        architecture = TINY if args.tiny else QWEN25_1_5B
        model_dir = build_model(architecture, torch.bfloat16 if on_gpu else torch.float32,
                                "cuda" if on_gpu else "cpu", Path(tmp) / "model")  # fmt: skip
        if args.tiny:
            args.tokens = 64
        elif args.long_context:
            args.tokens = 32768
        else:
            args.tokens = largest_fitting_tokens(model_dir, args.pp, gpu_gib, args.shape[1][1] + args.shape[2][1])
        total_tokens = args.shape[0] * (sum(args.shape[1]) + sum(args.shape[2])) // 2
        args.microbatches = max(math_ceil_div(total_tokens, args.tokens), 2 * args.pp)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = Path(tmp) / "out"
        out.mkdir()
        mp.start_processes(run_rank, (args.pp, port, model_dir, args, out), nprocs=args.pp, start_method="spawn")
        ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.pp)]
    step_s = max(statistics.median(rank["steps_s"]) for rank in ranks)
    flops, tokens = ranks[0]["flops"], ranks[0]["tokens"]
    result = dict(
        date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if on_gpu else "cpu (--tiny)",
        pp=args.pp, gpus=args.pp, micro_batch_tokens=args.tokens, pp_microbatches=args.microbatches,
        long_context=args.long_context, median_step_s=step_s, tokens_per_s=tokens / step_s,
        mfu=flops / step_s / (args.pp * args.peak_tflops * 1e12), ranks=ranks,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "ranks"}, indent=2))
    for rank, numbers in enumerate(ranks):
        print(f"rank {rank}: peak {numbers['peak_allocated_gib']} GiB allocated (planner "
              f"{numbers['predicted_gib']}); runtime: CUDA context and NCCL "
              f"{numbers['context_gib']} GiB, allocator slack {numbers['allocator_slack_gib']} GiB")  # fmt: skip
    write_result(args.json, result)


if __name__ == "__main__":
    main()
