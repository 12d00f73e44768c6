"""Shared by the benchmarks: model builders, a GRPO-shaped batch, the FLOP count of a training step, the
machine's matmul peak, and writing a result file. (A leading underscore: `make bench` runs bench/[!_]*.py.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def write_result(path: Path, result: dict) -> None:
    """A benchmark's numbers as indented JSON at `path` (bench/results/NAME.json by default), its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def run_cli(arguments: list[str], steps: int, val_every: int) -> tuple[list[dict], float]:
    """`reinforge ARGUMENTS` for `steps` steps in a subprocess with a temporary run directory (no final
    checkpoint): its metrics.jsonl rows and wall time; a failed run exits with the tail of its stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            *(sys.executable, "-m", "reinforge.cli", *arguments),
            *(f"loop.max_steps={steps}", f"loop.val_every={val_every}", f"logging.run_dir={tmp}/run"),
            "checkpoint.save_final=false",
        ]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"reinforge {' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, wall


# A Qwen2 of ~30M parameters (27.5M with the demo tokenizer's 449-token vocabulary)
MODEL_30M = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8
)
# Qwen2.5-1.5B's architecture (its config.json), for random initialisation
QWEN25_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def build_30m_model(out_dir: Path) -> Path:
    """A randomly initialised ~30M-parameter Qwen2 with the demo model's tokenizer (seed 0), saved."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    base = AutoConfig.from_pretrained(ROOT / "models" / "demo")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=base.vocab_size,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        **MODEL_30M,
    )
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(ROOT / "models" / "demo").save_pretrained(out_dir)
    return out_dir


def grpo_like_batch(
    num_sequences: int,
    prompt_tokens: tuple[int, int],
    response_tokens: tuple[int, int],
    vocab_size: int,
    num_generations: int = 8,
    seed: int = 0,
    shared_prompts: bool = False,
):
    """A TrainBatch shaped like a GRPO rollout: prompt and response lengths uniform in the given ranges,
    random tokens, the loss on the responses, advantages of both signs, old logprobs still to fill in.
    With `shared_prompts` the `num_generations` samples of a group have the same prompt (the group's
    first); without, every sequence has its own."""
    from reinforge.data.batch import Trajectory, collate

    rng = random.Random(seed)
    trajectories = []
    for index in range(num_sequences):
        num_prompt, num_response = rng.randint(*prompt_tokens), rng.randint(*response_tokens)
        ids = [rng.randrange(3, vocab_size) for _ in range(num_prompt + num_response)]
        prompt = trajectories[-1].prompt_ids if shared_prompts and index % num_generations else ids[:num_prompt]
        trajectories.append(
            Trajectory(prompt, ids[num_prompt:], [0.0] * num_response, False, 0.0, index // num_generations, "math")
        )
    return collate(trajectories, [rng.gauss(0.0, 1.0) for _ in trajectories], pad_token_id=0)


def layer_dims(model_config) -> tuple[int, int]:
    """(weights of one decoder layer's matmuls: attention projections and the gated MLP, the width of
    its attention: heads x head dim) of a Llama/Qwen-style model."""
    config = model_config.get_text_config()
    hidden, head_dim = (
        config.hidden_size,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size, q


def training_flops(config, batch) -> float:
    """Model FLOPs of one forward + backward (3x the forward) on `batch`, as reinforge computes it:
    decoder matmuls on every real token (2 FLOPs per weight), causal attention (QK^T and AV over the
    L(L+1)/2 causal pairs of each sequence, per layer), and the LM head on the trained tokens only (the
    chunked head's recompute in the backward pass is not counted: it is not model work)."""
    weights_per_layer, width = layer_dims(config)
    layers = config.num_hidden_layers
    lengths = batch.attention_mask.sum(dim=1).double()
    forward = (
        2 * weights_per_layer * layers * lengths.sum()
        + 2 * width * layers * (lengths * (lengths + 1)).sum()
        + 2 * config.hidden_size * config.vocab_size * batch.loss_mask.sum()
    )
    return 3 * float(forward)


def matmul_peak_flops(dtype: torch.dtype, device: str, size: int, repeats: int = 5) -> float:
    """The best FLOP/s of a [size x size] @ [size x size] torch.matmul over `repeats` tries (after a warm-up)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_train_steps(backend, batch, num_steps: int, device: str) -> list[float]:
    """Seconds of each of `num_steps` calls of the backend's train_step on `batch` (GRPO's clipped loss), the
    device synchronised before and after each."""
    steps = []
    for _ in range(num_steps):
        synchronize(device)
        start = time.perf_counter()
        backend.train_step(batch, clipped_token_mean_loss)
        synchronize(device)
        steps.append(time.perf_counter() - start)
    return steps


def policy_backend(model_config, training, lr: float, num_optimizer_steps: int, fsdp2_rank: bool = False):
    """The training backend as the RL recipes build it for the policy (logprobs at temperature 1, AdamW at `lr`,
    no reference): in this process, or with `fsdp2_rank` as FSDP2's only rank (a world of 1 on a free port)."""
    from reinforge.network import free_port
    from reinforge.training.backend import Backend
    from reinforge.training.fsdp2 import FSDP2Strategy
    from reinforge.training.heads import LogprobHead
    from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

    return Backend(
        model_config,
        training,
        OptimizerConfig(lr=lr),
        SchedulerConfig(),
        num_optimizer_steps,
        head=LogprobHead(temperature=1.0),
        strategy=FSDP2Strategy(0, 1, "127.0.0.1", free_port()) if fsdp2_rank else None,
    )


def clipped_token_mean_loss(logprobs_BT, micro, norm):
    """The benchmarks' loss: GRPO's clipped ratio (0.2 / 0.28), token mean over the global batch, no KL."""
    from reinforge.algorithms.losses import grpo_loss, token_mean

    return grpo_loss(
        logprobs_BT,
        micro.old_logprobs,
        micro.advantages,
        micro.loss_mask,
        norm,
        aggregate=token_mean,
        eps_low=0.2,
        eps_high=0.28,
    )
