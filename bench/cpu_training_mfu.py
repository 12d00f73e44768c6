"""Training efficiency on this CPU: achieved FLOP/s of reinforge's GRPO training step on the ~30M model,
as a fraction of this machine's fp32 matmul peak, both measured in the same process.

    python bench/cpu_training_mfu.py --rounds 5 --json bench/results/cpu_training_mfu.json

The step is the training backend's `train_step` in this process (forward, loss, backward, grad clip, AdamW) on
a GRPO-shaped batch like bench/grpo_vs_trl.py's 30M work: 64 sequences of 30-42 prompt and 48 response tokens,
packed, in micro-batches of 4096 tokens, fp32. Its FLOPs are counted by `_common.training_flops` (decoder
matmuls, causal attention, the LM head on trained tokens; 3x the forward). The peak is the best FLOP/s of a
2048 x 2048 fp32 torch.matmul with the same number of threads. Each round measures the peak, then one training
step (and, for reference, the no-gradient logprob pass); on a shared machine the rounds interleave so both see
the same load. Reported: the median step's FLOP/s / the best peak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import (  # noqa: E402
    build_30m_model,
    clipped_token_mean_loss,
    grpo_like_batch,
    matmul_peak_flops,
    policy_backend,
    training_flops,
    write_result,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default (all cores)")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--no-packing", action="store_true")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "cpu_training_mfu.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from reinforge.model_config import ModelConfig
    from reinforge.training.base import TrainingConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_30m_model(Path(tmp) / "qwen2-30m")
        training = TrainingConfig(
            global_batch_size=args.sequences,
            micro_batch_size=args.sequences,
            micro_batch_tokens=args.micro_batch_tokens,
            sequence_packing=not args.no_packing,
        )
        backend = policy_backend(
            ModelConfig(name_or_path=str(model_dir)), training, lr=1e-4, num_optimizer_steps=args.rounds + 1
        )
    config = backend.model.config
    batch = grpo_like_batch(args.sequences, (30, 42), (48, 48), config.vocab_size)
    flops = training_flops(config, batch)
    batch.old_logprobs = backend.logprobs(batch)
    backend.train_step(batch, clipped_token_mean_loss)  # warm-up: first allocations, AdamW state
    peaks, steps, logprob_passes = [], [], []
    for round_index in range(args.rounds):
        peaks.append(matmul_peak_flops(torch.float32, "cpu", 2048))
        start = time.perf_counter()
        batch.old_logprobs = backend.logprobs(batch)
        logprob_passes.append(time.perf_counter() - start)
        start = time.perf_counter()
        backend.train_step(batch, clipped_token_mean_loss)
        steps.append(time.perf_counter() - start)
        print(
            f"round {round_index + 1}: peak {peaks[-1] / 1e9:.1f} GFLOP/s, train step {steps[-1]:.2f} s "
            f"({flops / steps[-1] / 1e9:.1f} GFLOP/s), logprob pass {logprob_passes[-1]:.2f} s",
            flush=True,
        )
    peak, step_s = max(peaks), statistics.median(steps)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "parameters": sum(p.numel() for p in backend.model.parameters()),
        "sequences": args.sequences,
        "real_tokens": int(batch.attention_mask.sum()),
        "trained_tokens": int(batch.loss_mask.sum()),
        "sequence_packing": not args.no_packing,
        "micro_batch_tokens": args.micro_batch_tokens,
        "train_step_flops": flops,
        "median_train_step_s": step_s,
        "train_flops_per_s": flops / step_s,
        "matmul_peak_flops_per_s": peak,
        "matmul_peaks": peaks,
        "train_steps_s": steps,
        "fraction_of_matmul_peak": flops / step_s / peak,
        # forward only: a third of the training FLOPs
        "logprob_pass_fraction_of_peak": flops / 3 / statistics.median(logprob_passes) / peak,
    }
    print(
        f"training step: {result['train_flops_per_s'] / 1e9:.1f} GFLOP/s = "
        f"{result['fraction_of_matmul_peak']:.1%} of the "
        f"{peak / 1e9:.1f} GFLOP/s fp32 matmul peak ({result['threads']} thread(s)); logprob pass "
        f"{result['logprob_pass_fraction_of_peak']:.1%}"
    )
    write_result(args.json, result)


if __name__ == "__main__":
    main()
