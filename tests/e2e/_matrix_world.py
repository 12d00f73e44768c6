"""The conformance matrix's layout cells (FSDP2 on 2 ranks, tp=2, cp=2; tests/e2e/_matrix.py): one world of two gloo
ranks spawned once for every family and layout. Each rank builds the trainer (`Backend` on `FSDP2Strategy`, the
shared-prompt layout, the default), computes the logprobs of a batch of the demo's prompts with varied responses, and
takes one training step; the cell's number is token_mult_prob_error of those logprobs against transformers' own
forward of each sequence alone (what the HF engine computes), at most MISMATCH["hf"].

The layout cells' models have as many key/value heads as attention heads (tests/model_families.py's have one), so
that tp=2 and cp=2 divide them: a refusal here is the family's, not the tiny model's shape.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import model_families
import torch
from _matrix import MISMATCH, ROOT, WORLD_LAYOUTS, Outcome, exception_line
from test_fsdp2_worker import launch

from reinforge.algorithms.consistency import mismatch_metrics
from reinforge.algorithms.sft import nll_loss
from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ReinforgeError
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig

NUM_PROMPTS, SAMPLES = 4, 2  # two responses per prompt: the shared-prompt layout shares something
WORLD_TIMEOUT_S = 600


def as_many_kv_heads(config) -> None:
    if getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads = config.num_attention_heads


def build_world_model(name: str, path: Path) -> Path:
    return model_families.build(name, path, edit=as_many_kv_heads)


def demo_batch(model_dir: Path):
    """The demo's first prompts in the chat template, each with SAMPLES responses of 12-30 random tokens (sequences of
    40-70 tokens: longer than the families' windows of 8), with transformers' own logprobs of the responses."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    lines = (ROOT / "data" / "demo" / "train.jsonl").read_text().splitlines()[:NUM_PROMPTS]
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for group, line in enumerate(lines):
        messages = [{"role": "user", "content": json.loads(line)["prompt"]}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        if not isinstance(prompt[0], int):  # a BatchEncoding in some transformers versions
            prompt = list(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            )
        for sample in range(SAMPLES):
            length = 12 + (7 * group + 11 * sample) % 19
            response = torch.randint(3, model.config.vocab_size, (length,), generator=generator).tolist()
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
            own = logprobs.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0].tolist()
            trajectories.append(Trajectory(prompt, response, own, False, 0.0, group, "math"))
    advantages = torch.randn(len(trajectories), generator=generator).tolist()
    return collate(trajectories, advantages, pad_token_id=tokenizer.pad_token_id)


def run_cell(rank, world_size, port, model_dir, batch, layout) -> dict:
    strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
    training = TrainingConfig(
        micro_batch_size=4,
        global_batch_size=len(batch),
        parallel=ParallelConfig(**WORLD_LAYOUTS[layout]),
        backend="fsdp2",
        num_workers=world_size,
        collective_timeout_s=60,  # a rank that fails alone leaves the other waiting this long
    )
    torch.manual_seed(0)
    backend = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        training,
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=2,
        head=LogprobHead(temperature=1.0),
        strategy=strategy,
    )
    try:
        logprobs = backend.logprobs(batch)
        metrics = backend.train_step(batch, nll_loss)
    finally:
        backend.shutdown()
    return {"logprobs": logprobs, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


def run_rank(rank, world_size, ports, cells, out_dir, batches):
    """Every (family, layout) cell in turn, each in a process group of its own; a cell's failure is its result."""
    torch.set_num_threads(1)
    results = {}
    for port, (name, layout, model_dir) in zip(ports, cells, strict=True):
        began = time.perf_counter()
        try:
            result = run_cell(rank, world_size, port, model_dir, batches[name], layout)
        except ReinforgeError as exc:
            result = {"refused": str(exc)}
        except Exception as exc:  # noqa: BLE001 -- the cell's outcome: a traceback
            result = {"error": "traceback: " + exception_line(exc)}
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        results[name, layout] = result | {"seconds": time.perf_counter() - began}
    torch.save(results, out_dir / f"rank{rank}.pt")


def run_world(families: list[str], base: Path) -> dict[tuple[str, str], Outcome]:
    """Every family's layout cells in one world of two ranks; their outcomes."""
    models = {name: build_world_model(name, base / "models" / name) for name in families}
    batches = {name: demo_batch(models[name]) for name in families}
    cells = [(name, layout, models[name]) for name in families for layout in WORLD_LAYOUTS]
    out_dir = base / "world"
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = launch(2, cells, out_dir, batches, target=run_rank, timeout_s=WORLD_TIMEOUT_S, num_ports=len(cells))
    return {(name, layout): world_outcome(ranks, name, layout, batches[name]) for name, layout, _ in cells}


def world_outcome(ranks: list[dict], name: str, layout: str, batch) -> Outcome:
    results = [rank[name, layout] for rank in ranks]
    seconds = round(max(result["seconds"] for result in results), 1)
    for key, kind in (("error", "error"), ("refused", "refused")):
        lines = [result[key] for result in results if key in result]
        if lines:
            line = lines[0]
            if kind == "refused" and (len(set(lines)) > 1 or len(lines) < len(results) or "\n" in line):
                kind, line = "error", "the ranks disagree or the error is not one line: " + line[:300]
            return Outcome(kind, line, None, seconds)
    errors = []
    for result in results:
        batch.old_logprobs = result["logprobs"]
        errors.append(mismatch_metrics(batch)["train/token_mult_prob_error"])
    worst = max(errors)
    if not all(math.isfinite(result[key]) for result in results for key in ("loss", "grad_norm")):
        return Outcome(
            "error", f"a training step's loss or gradient norm is not finite: {results[0]['loss']}", worst, seconds
        )
    if worst > MISMATCH["hf"]:
        return Outcome("mismatch", f"mismatch {worst:.4f} > {MISMATCH['hf']} against transformers", worst, seconds)
    return Outcome("pass", f"mismatch {worst:.6f}", worst, seconds)
