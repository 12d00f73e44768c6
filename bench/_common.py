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
    return build_random_qwen2(out_dir, MODEL_30M)


def build_random_qwen2(out_dir: Path, shape: dict, dtype: torch.dtype = torch.float32) -> Path:
    """A randomly initialised Qwen2 of `shape` (config overrides) with the demo model's vocabulary and tokenizer
    (seed 0), saved in `dtype`."""
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
        **shape,
    )
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(ROOT / "models" / "demo").save_pretrained(out_dir)
    return out_dir


def grow_demo_model(out_dir: Path) -> Path:
    """models/demo grown to the ~30M Qwen2's shape (MODEL_30M), computing the demo's function, saved.

    Function-preserving growth (Net2Net, LLaMA Pro's block expansion): the demo's weights fill the top-left corner
    of each larger matrix; every new weight that reads (q/k/v, gate/up, new heads and hidden units) is random
    (std 0.02, as transformers initialises), every new weight that writes into the residual stream (o_proj and
    down_proj outside the corner, the embedding's new columns, so the tied head's) is zero, and a new decoder block
    after each of the demo's is the identity at first. The RMSNorm weights are scaled by sqrt(128 / 512) (its mean
    runs over zeros too) and its epsilon by 128 / 512: logits equal the demo's exactly (divisions by powers of 2).
    The writes get gradients on the first step and the reads from the second (once the writes have moved), so
    training moves all ~30M weights from a model that already does the demo's arithmetic: a 30M model trained
    from scratch needs hours on 2 cores to learn it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    demo_dir = ROOT / "models" / "demo"
    small = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    old = small.config
    settings = {key: value for key, value in old.to_dict().items() if key != "layer_types"}
    config = Qwen2Config(**{**settings, **MODEL_30M})
    ratio = old.hidden_size / config.hidden_size
    if old.hidden_size // old.num_attention_heads != config.hidden_size // config.num_attention_heads:
        raise SystemExit("growing models/demo needs the same head size in both shapes")
    config.rms_norm_eps = old.rms_norm_eps * ratio
    torch.manual_seed(0)
    model = type(small)(config)
    old_state = small.state_dict()
    stride = config.num_hidden_layers // old.num_hidden_layers
    with torch.no_grad():
        for name, weight in model.state_dict().items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                weight.zero_()  # writes into the residual stream: zero outside the demo's corner
            if name.endswith("norm.weight"):
                weight.fill_(ratio**0.5)
            source = name
            if ".layers." in name:
                index = int(name.split(".layers.")[1].split(".")[0])
                if index % stride:
                    continue  # a new block: the identity while its writes are zero
                source = name.replace(f".layers.{index}.", f".layers.{index // stride}.")
            if source not in old_state:
                continue
            value = old_state[source]
            if name.endswith("norm.weight"):
                value = value * ratio**0.5
            weight[tuple(slice(0, size) for size in value.shape)] = value
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out_dir)
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
    from reinforge.algorithms.losses import clipped_policy_loss, token_mean

    return clipped_policy_loss(
        logprobs_BT,
        micro.old_logprobs,
        micro.advantages,
        micro.loss_mask,
        norm,
        aggregate=token_mean,
        eps_low=0.2,
        eps_high=0.28,
    )
