"""GPU: reinforge's FSDP2 training backend on a 1.5B-parameter Qwen2.5-architecture model (random
initialisation, bf16 compute, fp32 master weights and AdamW state), one GPU: step time, tokens/s, MFU
and peak memory.

    python bench/gpu_training_mfu.py --json bench/results/gpu_training_mfu.json
    python bench/gpu_training_mfu.py --tiny      # a tiny model on CPU through the same code: checks it runs

The step is the training backend's `train_step` on one FSDP2 rank (world size 1: FSDP2 with its all-gathers,
mixed precision and gradient reduction as on N GPUs) on a GRPO-shaped batch: 128 sequences of 128-384 prompt
and 256-1024 response tokens, packed (`training.sequence_packing`), in micro-batches of 16,384 tokens, LM head
in chunks of 2048 tokens. MFU = the step's model FLOPs (`_common.training_flops`) / the step time / the H200's
dense bf16 peak (989 TFLOP/s; --peak-tflops), also given as a fraction of a 8192^3 bf16 matmul measured in the
same process. Peak memory is torch.cuda.max_memory_allocated. Without a GPU (and without --tiny) it says so
and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import (  # noqa: E402
    QWEN25_1_5B,
    clipped_token_mean_loss,
    grpo_like_batch,
    matmul_peak_flops,
    policy_backend,
    synchronize,
    time_train_steps,
    training_flops,
    write_result,
)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def build_model(architecture: dict, dtype: torch.dtype, device: str, out_dir: Path) -> Path:
    """A randomly initialised Qwen2 (seed 0), built on `device` (fast on a GPU) and saved in `dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(eos_token_id=1, pad_token_id=0, bos_token_id=None, **architecture))
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny fp32 model on CPU (gloo): checks that the script runs"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--no-packing", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="training.compile: torch.compile each decoder layer")
    parser.add_argument("--profile", action="store_true", help="print the step's 25 costliest kernels (torch.profiler)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H200: 989)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gpu_training_mfu.json")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.tiny:
        print("no CUDA GPU here: nothing measured (--tiny runs a tiny model on CPU through the same code)")
        return

    from reinforge.model_config import ModelConfig
    from reinforge.training.base import TrainingConfig

    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if not on_gpu:
        torch.set_num_threads(1)  # a tiny model: two OpenMP threads beside gloo's only wait on each other
    architecture = TINY if args.tiny else QWEN25_1_5B
    sequences, prompt, response = (8, (4, 12), (8, 24)) if args.tiny else (args.sequences, (128, 384), (256, 1024))
    training = TrainingConfig(
        backend="fsdp2",
        global_batch_size=sequences,
        micro_batch_size=sequences,
        micro_batch_tokens=64 if args.tiny else args.micro_batch_tokens,
        sequence_packing=not args.no_packing,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(architecture, dtype, device, Path(tmp) / "model")
        model_config = ModelConfig(name_or_path=str(model_dir), dtype="bfloat16" if on_gpu else "float32")
        worker = policy_backend(model_config, training, lr=1e-6, num_optimizer_steps=args.steps + 2, fsdp2_rank=True)
    config = worker.model.config
    batch = grpo_like_batch(sequences, prompt, response, config.vocab_size)
    flops = training_flops(config, batch)
    batch.old_logprobs = worker.logprobs(batch)
    for _ in range(2):  # warm-up: allocator, AdamW state
        worker.train_step(batch, clipped_token_mean_loss)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    steps = time_train_steps(worker, batch, args.steps, device)
    peak_memory_gb = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as profiler:
            worker.train_step(batch, clipped_token_mean_loss)
            synchronize(device)
        sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort_by, row_limit=25, max_name_column_width=60))
    matmul_peak = matmul_peak_flops(dtype, device, 512 if args.tiny else 8192)
    worker.shutdown()
    step_s = statistics.median(steps)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (--tiny)",
        "dtype": str(dtype),
        "parameters": sum(p.numel() for p in worker.model.parameters()),
        "sequences": sequences,
        "real_tokens": int(batch.attention_mask.sum()),
        "trained_tokens": int(batch.loss_mask.sum()),
        "sequence_packing": training.sequence_packing,
        "micro_batch_tokens": training.micro_batch_tokens,
        "activation_checkpointing": training.activation_checkpointing,
        "compile": training.compile,
        "median_step_s": step_s,
        "steps_s": steps,
        "tokens_per_s": int(batch.attention_mask.sum()) / step_s,
        "train_step_flops": flops,
        "achieved_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / (args.peak_tflops * 1e12),
        "peak_tflops": args.peak_tflops,
        "measured_matmul_tflops": matmul_peak / 1e12,
        "fraction_of_measured_matmul": flops / step_s / matmul_peak,
        "peak_memory_gb": peak_memory_gb,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "steps_s"}, indent=2))
    write_result(args.json, result)


if __name__ == "__main__":
    main()
