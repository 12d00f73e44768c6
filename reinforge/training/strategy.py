"""Where a training backend's model runs: the parallelism strategy, applied to a plain model.

A strategy is what differs between training in one process and on N FSDP2 ranks (training/fsdp2.py): which
micro-batches of a batch this process computes, how per-token outputs are assembled (here, or gathered from
every rank), gradient clipping by the global norm, metric reduction, the model's placement (moved, or
sharded), its full weights for refit, and checkpoints. The backend (training/backend.py) calls the same free
functions (micro-batch plans, segment attention, the chunked LM head, backward, clip, step) on either.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from reinforge.data.batch import TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.lora import adapter_state_dict, load_adapter_state_dict
from reinforge.training.micro_batching import MicroBatchPlan, Prompts, select_micro_batch

# plan(lengths, prompts) -> the micro-batches of sequences of these lengths (the backend's planner)
Plan = Callable[[list[int], "Prompts | None"], MicroBatchPlan]
# compute(micro, rows) -> [b, t] outputs of one micro-batch
Compute = Callable[[TrainBatch, list[list[int]]], torch.Tensor]
# (indices of the micro-batch's sequences in the batch or this rank's share, micro-batch on the device, its rows)
MicroBatch = tuple[list[int], TrainBatch, list[list[int]]]


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """Every tensor field of the batch (of any `TrainBatch` subclass) on `device`."""
    return replace(
        batch,
        **{
            f.name: value.to(device) for f in fields(batch) if isinstance(value := getattr(batch, f.name), torch.Tensor)
        },
    )


class Strategy(Protocol):
    device: torch.device
    is_main: bool  # the process that writes files and answers remote callers

    def setup(self, training: TrainingConfig) -> None:
        """Start what the strategy needs (a process group) in the process that trains."""
        ...

    def load_config(self, model_config: ModelConfig) -> ModelConfig:
        """The model settings to load the model with (FSDP2 keeps fp32 master weights)."""
        ...

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model placed for training: as it is, or sharded over the ranks."""
        ...

    def micro_batches(self, batch: TrainBatch, plan: Plan) -> Iterator[MicroBatch]:
        """This process's micro-batches of the batch."""
        ...

    def per_token(self, batch: TrainBatch, plan: Plan, compute: Compute) -> torch.Tensor:
        """`compute` over the micro-batches, assembled into the whole batch's [B, T], 0 off `batch.loss_mask`."""
        ...

    def clip_gradients(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm; the norm before clipping."""
        ...

    def reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        """Summed metrics and `*_max`/`*_min` extremes over the whole batch."""
        ...

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole (unsharded) state dict."""
        ...

    def save_pretrained(self, model: torch.nn.Module, path: Path) -> None: ...

    def save_adapter(self, model: torch.nn.Module, peft: torch.nn.Module, path: Path) -> None: ...

    def save_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None: ...

    def load_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None: ...

    def shutdown(self) -> None: ...


class LocalStrategy:
    """The whole model in this process, on the device it was loaded on."""

    is_main = True

    def __init__(self):
        self.device = torch.device("cpu")
        self.config: TrainingConfig | None = None

    def setup(self, training: TrainingConfig) -> None:
        self.config = training

    def load_config(self, model_config: ModelConfig) -> ModelConfig:
        return model_config

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        self.device = next(model.parameters()).device
        return model

    def micro_batches(self, batch: TrainBatch, plan: Plan) -> Iterator[MicroBatch]:
        for rows in plan(batch.attention_mask.sum(dim=1).tolist(), Prompts.of(batch, self.config)):
            micro, local_rows, indices = select_micro_batch(batch, rows)
            yield indices, batch_to(micro, self.device), local_rows

    def per_token(self, batch: TrainBatch, plan: Plan, compute: Compute) -> torch.Tensor:
        out = torch.zeros_like(batch.loss_mask)
        for indices, micro, rows in self.micro_batches(batch, plan):
            values_BT = compute(micro, rows)
            out[indices, : values_BT.shape[1]] = values_BT.to(out.device)
        return out * batch.loss_mask

    def clip_gradients(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        return {name: float(value) for name, value in (totals | extremes).items()}

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def save_pretrained(self, model: torch.nn.Module, path: Path) -> None:
        model.save_pretrained(path)

    def save_adapter(self, model: torch.nn.Module, peft: torch.nn.Module, path: Path) -> None:
        peft.save_pretrained(path)

    def save_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
        """One file, state.pt: the model's weights (with LoRA the adapter's only), AdamW and schedule state."""
        path.mkdir(parents=True, exist_ok=True)
        weights = adapter_state_dict(model) if adapter_only else model.state_dict()
        torch.save(
            {"model": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            path / "state.pt",
        )

    def load_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
        state = torch.load(path / "state.pt", weights_only=False)
        if adapter_only:
            load_adapter_state_dict(model, state["model"])
        else:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    def shutdown(self) -> None:
        pass
