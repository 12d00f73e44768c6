"""Full fine-tuning against LoRA on the same GRPO training step: trainable parameters, optimizer-state bytes,
peak memory and step time, in one run.

    python bench/lora_memory.py --json bench/results/lora_memory.json                      # the ~30M model, CPU
    python bench/lora_memory.py --model qwen1.5b --json bench/results/lora_memory_gpu.json   # Qwen2.5-1.5B-shaped, CUDA

Each setting (full fine-tuning; LoRA rank 16, alpha 32, all-linear) runs in a fresh process of its own, so
that its peak memory is its own: on CPU the peak resident set (getrusage's ru_maxrss, which a process
carries over from its parent: this driver imports nothing heavy), on CUDA torch.cuda.max_memory_allocated. On CPU
the settings' processes run with a fixed glibc mmap threshold
(`--malloc-mmap-threshold`): without it their peak RSS differs by up to 0.8 GiB from run to run, more than LoRA
saves on this model.
The process builds the backend, takes one warm-up step (the first allocations, AdamW's state) and times
`--steps` more; the step time is their median. The step is `train_step` (forward, loss, backward, clipping,
AdamW) on the same GRPO-shaped batch (`_common.grpo_like_batch`, GRPO's clipped loss, no KL term: with one,
full fine-tuning also keeps a reference copy of the model, LoRA none) of
- `--model 30m` (default): the ~30M Qwen2 (`_common.build_30m_model`, fp32) on the torch backend, 64
  sequences of 30-42 prompt and 48 response tokens, packed in micro-batches of 4096 tokens (as
  bench/cpu_training_mfu.py);
- `--model qwen1.5b`: a randomly initialised Qwen2.5-1.5B-shaped model (`_common.QWEN25_1_5B`) in bf16 on
  one CUDA GPU through the FSDP2 backend at world size 1 (the torch backend runs on the CPU), fp32 master
  weights and AdamW state, 32 sequences of 128-384 prompt and 256-1024 response tokens in micro-batches of
  16,384 tokens (`--backend fsdp2` runs the 30M model through it on CPU, over gloo).
Optimizer-state bytes are every tensor in AdamW's state (exp_avg, exp_avg_sq, step); gradient bytes those of
the gradients the step leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("full", "lora")
LORA = dict(rank=16, alpha=32.0, target_modules="all-linear")
BATCHES = {
    "30m": dict(sequences=64, prompt=(30, 42), response=(48, 48), micro_batch_tokens=4096),
    "qwen1.5b": dict(sequences=32, prompt=(128, 384), response=(256, 1024), micro_batch_tokens=16384),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(BATCHES), default="30m")
    parser.add_argument(
        "--backend", choices=("torch", "fsdp2"), help="default: torch for 30m, fsdp2 (CUDA) for qwen1.5b"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting, after one warm-up step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU; 0: torch's default (all cores)")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        metavar="BYTES",
        default=65536,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the settings' processes (default 65536; 0: glibc's own, dynamic): "
        "a fixed threshold stops glibc from raising it as large tensors are freed, after which freed memory stays in "
        "the heap and counts in the peak RSS (by 0.5-0.8 GiB here, at random); the price is a page fault per large "
        "allocation, which makes CPU steps slower",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "lora_memory.json")
    parser.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)  # one setting, in this process
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)  # write the model to --model-dir
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.backend = args.backend or ("fsdp2" if args.model == "qwen1.5b" else "torch")
    if args.build:
        build_model(args.model, args.model_dir)
        return
    if args.worker:
        print(json.dumps(measure(args)))
        return
    if args.model == "qwen1.5b" and not cuda_available():
        print("--model qwen1.5b needs a CUDA GPU: nothing measured")
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.model
        subprocess.run(
            [sys.executable, __file__, "--build", "--model", args.model, "--model-dir", str(model_dir)], check=True
        )
        for setting in SETTINGS:
            command = [
                sys.executable,
                __file__,
                "--worker",
                setting,
                "--model-dir",
                str(model_dir),
                "--model",
                args.model,
                "--backend",
                args.backend,
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
            ]
            env = {
                **os.environ,
                **({"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else {}),
            }
            output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            results[setting] = json.loads(output.strip().splitlines()[-1])
            print(f"{setting}: {json.dumps(results[setting])}", flush=True)
    full, lora = results["full"], results["lora"]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "backend": args.backend,
        "load_average": list(os.getloadavg()),
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "lora_config": LORA,
        **BATCHES[args.model],
        **results,
        "trainable_fraction": lora["trainable_parameters"] / full["trainable_parameters"],
        "optimizer_state_ratio": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
        "peak_memory_ratio": lora["peak_memory_gb"] / full["peak_memory_gb"],
        "step_time_ratio": lora["median_step_s"] / full["median_step_s"],
    }
    print(f"{'setting':<8} {'trainable':>12} {'optimizer state':>16} {'peak memory':>12} {'step':>8}")
    for setting in SETTINGS:
        r = results[setting]
        print(
            f"{setting:<8} {r['trainable_parameters']:>12,} {r['optimizer_state_bytes'] / 2**20:>12.1f} MiB "
            f"{r['peak_memory_gb']:>9.3f} GiB {r['median_step_s']:>7.2f}s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


def build_model(model: str, out_dir: Path) -> None:
    """The benchmark's model, saved (in a process of its own, so that no setting's peak includes it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    if model == "30m":
        from _common import build_30m_model

        build_30m_model(out_dir)
        return
    import torch
    from _common import QWEN25_1_5B
    from gpu_training_mfu import build_model as build_on_device

    build_on_device(QWEN25_1_5B, torch.bfloat16, "cuda", out_dir)


def cuda_available() -> bool:
    command = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    return subprocess.run(command, capture_output=True, text=True).stdout.strip() == "True"


def measure(args: argparse.Namespace) -> dict:
    """One setting in this (fresh) process: its backend, a warm-up step, `args.steps` timed ones, its memory."""
    import statistics

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from _common import clipped_token_mean_loss, grpo_like_batch, policy_backend, time_train_steps

    from reinforge.logging.memory import memory_metrics
    from reinforge.model_config import LoraConfig, ModelConfig
    from reinforge.training.base import TrainingConfig

    on_gpu = args.model == "qwen1.5b"
    if args.threads and not on_gpu:
        torch.set_num_threads(args.threads)
    shape = BATCHES[args.model]
    training = TrainingConfig(
        backend=args.backend,
        global_batch_size=shape["sequences"],
        micro_batch_size=shape["sequences"],
        micro_batch_tokens=shape["micro_batch_tokens"],
    )
    model_config = ModelConfig(
        name_or_path=str(args.model_dir),
        dtype="bfloat16" if on_gpu else "float32",
        lora=LoraConfig(**LORA) if args.worker == "lora" else None,
    )
    backend = policy_backend(
        model_config, training, lr=1e-5, num_optimizer_steps=args.steps + 1, fsdp2_rank=args.backend == "fsdp2"
    )
    device = "cuda" if on_gpu else "cpu"
    loaded = memory_metrics(prefix="")
    batch = grpo_like_batch(shape["sequences"], shape["prompt"], shape["response"], backend.model.config.vocab_size)
    batch.old_logprobs = backend.logprobs(batch)
    backend.train_step(batch, clipped_token_mean_loss)  # warm-up: first allocations, AdamW state
    steps = time_train_steps(backend, batch, args.steps, device)
    peak = memory_metrics(prefix="")
    parameters = list(backend.model.parameters())
    result = {
        "parameters": sum(p.numel() for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
        "optimizer_state_bytes": sum(
            t.numel() * t.element_size()
            for state in backend.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        ),
        "gradient_bytes": sum(p.grad.numel() * p.grad.element_size() for p in parameters if p.grad is not None),
        "peak_memory_gb": peak["gpu_peak_memory_gb"] if on_gpu else peak["peak_rss_gb"],
        "memory_after_load_gb": loaded["gpu_peak_memory_gb"] if on_gpu else loaded["peak_rss_gb"],
        "median_step_s": statistics.median(steps),
        "steps_s": steps,
        "threads": torch.get_num_threads(),
        "real_tokens": int(batch.attention_mask.sum()),
        "trained_tokens": int(batch.loss_mask.sum()),
    }
    if args.backend == "fsdp2":
        backend.shutdown()
    return result


if __name__ == "__main__":
    main()
