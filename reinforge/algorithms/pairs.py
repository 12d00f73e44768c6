"""What the two preference-pair recipes (`dpo.py`, `rm.py`) share: the run config's common sections and
checks, one optimizer step over a global batch of pairs, and the held-out pass.

Batch sizes count sequences, as everywhere in `training`: a pair is two sequences (chosen and
rejected, always in the same micro-batch), so `training.global_batch_size / 2` pairs make one
optimizer step and `training.micro_batch_size / 2` pairs one forward/backward pass.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from pydantic import model_validator

from reinforge.config.schema import CheckpointConfig, ModelConfig, TrainingConfig
from reinforge.config.section import Section
from reinforge.data.preference import PairBatch, PreferenceDataConfig, TokenizedPair, collate_pairs

# micro_loss(batch, rows, num_pairs) -> (loss, summable metric contributions): `batch` holds the pairs
# `rows` of the global batch; `num_pairs` is the global batch's, the loss's normaliser.
MicroLoss = Callable[[PairBatch, slice, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class PairRunConfig(Section):
    """The sections every pair recipe has; each recipe adds its own."""

    seed: int = 0
    """Seed for the data order and any freshly initialised weights."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (all cores)."""
    model: ModelConfig = ModelConfig()
    """The model to start from (a causal LM in Hugging Face format)."""
    data: PreferenceDataConfig = PreferenceDataConfig()
    """The preference pairs."""
    training: TrainingConfig = TrainingConfig()
    """Optimizer and batch sizes, in sequences (two per pair); only `backend: torch` is supported."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Whether to write the trained model to RUN_DIR/final."""

    @model_validator(mode="after")
    def _check_training(self) -> "PairRunConfig":
        t = self.training
        if t.backend != "torch" or t.num_workers != 1 or t.cpu_offload:
            raise ValueError(
                "preference training runs in one process: set training.backend=torch, training.num_workers=1, training.cpu_offload=false"
            )
        if t.global_batch_size < 2 or t.global_batch_size % 2 or t.micro_batch_size < 2 or t.micro_batch_size % 2:
            raise ValueError(
                f"training.global_batch_size={t.global_batch_size} and training.micro_batch_size={t.micro_batch_size} count "
                "sequences, two per pair (chosen and rejected): set both to even numbers, at least 2"
            )
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(
                f"training.micro_batch_size={t.micro_batch_size} does not divide training.global_batch_size={t.global_batch_size}; "
                f"set it to an even divisor of {t.global_batch_size}"
            )
        if t.lr <= 0:
            raise ValueError("training.lr must be > 0")
        if self.model.lora and self.model.lora.quantize_base != "none":
            raise ValueError(
                "model.lora.quantize_base (QLoRA) is not supported by preference training, which runs in one CPU "
                "process; set it to none"
            )
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0 (0: torch's default)")
        if self.data.max_length < 2:
            raise ValueError("data.max_length must be at least 2 tokens")
        return self


def check_schedule(max_steps: int, val_every: int, section: str) -> None:
    """The recipe's step counts, checked at load time."""
    if max_steps < 0:
        raise ValueError(f"{section}.max_steps must be >= 0")
    if val_every < 0:
        raise ValueError(f"{section}.val_every must be >= 0 (0: validate only before and after training)")


@dataclass
class PairRunResult:
    run_dir: Path
    first_val: dict[str, float]  # val/ metrics before training (empty without validation)
    last_val: dict[str, float]  # val/ metrics after the last step


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    pairs: list[TokenizedPair],
    micro_loss: MicroLoss,
    training: TrainingConfig,
    pad_token_id: int,
) -> dict[str, float]:
    """One AdamW step on a global batch of pairs: accumulate the gradient micro-batch by micro-batch
    (the loss is normalised by the global number of pairs, so this equals one big batch), clip, step."""
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = defaultdict(float)
    size = training.micro_batch_size // 2
    for start in range(0, len(pairs), size):
        rows = slice(start, min(start + size, len(pairs)))
        loss, metrics = micro_loss(collate_pairs(pairs[rows], pad_token_id), rows, len(pairs))
        loss.backward()
        for name, value in metrics.items():
            totals[name] += float(value)
    max_norm = training.max_grad_norm if training.max_grad_norm > 0 else float("inf")
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    totals["lr"] = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    return dict(totals)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, pairs: list[TokenizedPair], micro_loss: MicroLoss, micro_batch_size: int, pad_token_id: int
) -> dict[str, float]:
    """The loss and metrics of all `pairs` as one batch, in eval mode without gradients, prefixed `val/`."""
    model.eval()
    totals: dict[str, float] = defaultdict(float)
    size = micro_batch_size // 2
    for start in range(0, len(pairs), size):
        rows = slice(start, min(start + size, len(pairs)))
        _, metrics = micro_loss(collate_pairs(pairs[rows], pad_token_id), rows, len(pairs))
        for name, value in metrics.items():
            totals[f"val/{name}"] += float(value)
    model.train()
    return dict(totals)


def with_prefix(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{name}": value for name, value in metrics.items()}
