"""Per-step training time of one model under each parallel layout (training.parallel), on this machine.

Every layout trains the same GRPO-shaped batch (64 sequences of 96-160 tokens, micro-batches of 8) for a few
optimizer steps with the training backend on real gloo ranks (`FSDP2Strategy`, spawned processes, one torch
thread each); the median step after a warm-up one is reported with its loss, which must equal the one-process
loss (the layouts compute the same step). On CPU this measures the cost of each layout's collectives beside its
compute, not a speed goal: with 2 cores, 4 ranks share them. The GPU numbers come from bench/gpu_checks.sh.

    python bench/parallel_layouts.py --json bench/results/parallel_layouts.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from reinforge.algorithms.losses import clipped_policy_loss, token_mean
from reinforge.data.batch import Trajectory, collate
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig

# (name, ranks, training.parallel)
LAYOUTS = (
    ("one process", 1, None),
    ("dp=2", 2, dict()),
    ("tp=2", 2, dict(tp=2)),
    ("cp=2", 2, dict(cp=2)),
    ("dp=4", 4, dict()),
    ("dp=2 x tp=2", 4, dict(tp=2, dp_shard=2)),
)


def build_model(path: Path, hidden: int, layers: int) -> tuple[Path, int]:
    """A Qwen2 of `layers` layers, `hidden` wide (heads of 32, half as many key/value heads, vocab 4096), random
    weights (the default, 256 x 4: ~6M parameters); and its parameter count."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def make_batch(num_rows: int = 64):
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(num_rows):
        if row % 8 == 0:
            prompt = torch.randint(2, 4096, (48,), generator=gen).tolist()
        response = torch.randint(2, 4096, (48 + (row * 37) % 64,), generator=gen).tolist()
        trajectories.append(Trajectory(prompt, response, [0.0] * len(response), False, 0.0, row // 8, "math"))
    return collate(trajectories, torch.randn(num_rows, generator=gen).tolist(), pad_token_id=0)


def loss_fn(logprobs, micro, norm):
    return clipped_policy_loss(
        logprobs, micro.old_logprobs, micro.advantages, micro.loss_mask, norm, aggregate=token_mean, eps_low=0.2,
        eps_high=0.28, kl_coef=0.0,
    )  # fmt: skip


def train(strategy, model_dir: Path, parallel: dict | None, num_workers: int, steps: int) -> dict:
    torch.set_num_threads(1)
    training = TrainingConfig(
        micro_batch_size=8,
        global_batch_size=64,
        backend="fsdp2" if parallel is not None else "torch",
        num_workers=num_workers,
        parallel=ParallelConfig(**(parallel or {})),
    )
    backend = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        training,
        OptimizerConfig(lr=1e-4),
        SchedulerConfig(),
        num_optimizer_steps=steps,
        head=LogprobHead(temperature=1.0),
        strategy=strategy,
    )
    batch = make_batch()
    batch.old_logprobs = backend.logprobs(batch)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(backend.train_step(batch, loss_fn)["loss"])
        times.append(time.perf_counter() - start)
    backend.shutdown()
    return {"step_s": statistics.median(times[1:]), "losses": losses}


def run_rank(rank, world_size, port, model_dir, out, parallel, steps):
    strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
    result = train(strategy, model_dir, parallel, world_size, steps)
    if rank == 0:
        torch.save(result, out)


def measure(model_dir: Path, ranks: int, parallel: dict | None, steps: int, out: Path) -> dict:
    if parallel is None:
        return train(None, model_dir, None, 1, steps)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = (ranks, port, model_dir, out, parallel, steps)
    mp.start_processes(run_rank, args=args, nprocs=ranks, start_method="spawn")
    return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None, help="per device, for MFU (H200 bf16: 989)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, num_params = build_model(Path(tmp) / "model", args.hidden, args.layers)
        tokens = int(make_batch().attention_mask.sum())
        for name, ranks, parallel in LAYOUTS:
            result = measure(model_dir, ranks, parallel, args.steps, Path(tmp) / "result.pt")
            row = {"layout": name, "ranks": ranks, **result, "step_s": round(result["step_s"], 3)}
            if args.peak_tflops:  # 6 N flops per trained token (forward and backward), over every rank's peak
                row["mfu"] = round(6 * num_params * tokens / result["step_s"] / (args.peak_tflops * 1e12 * ranks), 4)
            rows.append(row)
            print(f"{name:>14}: {result['step_s']:.3f} s/step, losses {[round(x, 6) for x in result['losses']]}")
    reference = rows[0]["losses"]
    for row in rows:
        row["max_loss_difference"] = max(abs(a - b) for a, b in zip(row.pop("losses"), reference))
        row.pop("step_s_raw", None)
    if args.json:
        machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo), 1 torch thread per rank"
        summary = {"machine": machine, "parameters": num_params, "tokens_per_step": tokens, "steps": args.steps}
        args.json.write_text(json.dumps(summary | {"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
