"""The training backend interface.

A training backend owns the policy being trained (and the frozen reference policy when the KL term
needs it). It computes logprobs, takes optimizer steps with a loss function it is handed, gives out
its weights for refit, and exports them in Hugging Face format. The loss is a pure function of
tensors (see `algorithms/losses.py`), so the backend never knows which algorithm it trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from reinforge.algorithms.losses import Normalisers
from reinforge.data.batch import TrainBatch

# loss_fn(logprobs_BT, micro_batch, normalisers) -> (loss, summable metric contributions). logprobs_BT is
# [B, T] like micro_batch.loss_mask, and 0 off it: the backends compute logprobs on the trained tokens only.
LossFn = Callable[[torch.Tensor, TrainBatch, Normalisers], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainingBackend(Protocol):
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [B, T] of the policy (or the reference policy), without gradients."""
        ...

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on a global batch, accumulated over micro-batches."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) policy weights with Hugging Face names, for refit and export."""
        ...

    def save_adapter(self, path: Path) -> None:
        """With `model.lora`: write the adapter in PEFT's format (for the engine's adapter sync and for export)."""
        ...

    def save_pretrained(self, path: Path) -> None:
        """Write the policy and tokenizer as a Hugging Face directory."""
        ...

    def save_state(self, path: Path) -> None:
        """Write everything an exact resume needs: policy weights, optimizer and LR-schedule state."""
        ...

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote (same model, same optimizer settings)."""
        ...
