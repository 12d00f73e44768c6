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
from reinforge.modeling import resolve_device
from reinforge.training import state
from reinforge.training.base import TrainingConfig
from reinforge.training.micro_batching import MicroBatchPlan, Prompts, select_micro_batch
from reinforge.training.parallel.layout import ParallelConfig

# plan(lengths, prompts) -> the micro-batches of sequences of these lengths (the backend's planner)
Plan = Callable[[list[int], "Prompts | None"], MicroBatchPlan]
# compute(micro, rows) -> [b, t] outputs of one micro-batch
Compute = Callable[[TrainBatch, list[list[int]]], torch.Tensor]
# (indices of the micro-batch's sequences in the batch or this rank's share, micro-batch on the device, its rows)
MicroBatch = tuple[list[int], TrainBatch, list[list[int]]]
# loss(indices, micro, rows) -> the micro-batch's loss (the backend's, with the global batch's normalisers)
MicroLoss = Callable[[list[int], TrainBatch, list[list[int]]], torch.Tensor]


def run_passes(micro_batches: Iterator[MicroBatch], loss: MicroLoss, backward: bool) -> None:
    """Each micro-batch's loss, and its backward (`backward`), one micro-batch after another."""
    for micro_batch in micro_batches:
        value = loss(*micro_batch)
        if backward:
            value.backward()


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
    rank: int  # of `world_size` processes that train the model together
    world_size: int
    pipelined: bool  # micro-batches run through pipeline stages (training/parallel/pipeline.py)

    def setup(self, training: TrainingConfig) -> TrainingConfig:
        """Start what the strategy needs (a process group) in the process that trains; the settings with
        `training.parallel` resolved to this strategy's layout."""
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

    def passes(self, model: torch.nn.Module, batch: TrainBatch, plan: Plan, loss: MicroLoss, backward: bool) -> None:
        """`loss` of each of this process's micro-batches, differentiated with `backward`."""
        ...

    def per_token(self, batch: TrainBatch, plan: Plan, compute: Compute, model=None) -> torch.Tensor:
        """`compute` over the micro-batches, assembled into the whole batch's [B, T], 0 off `batch.loss_mask`
        (`model`: what `compute` runs, for a strategy that runs it in pipeline stages)."""
        ...

    def clip_gradients(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm; the norm before clipping."""
        ...

    def reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        """Summed metrics and `*_max`/`*_min` extremes over the whole batch."""
        ...

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise minimum of `values` (on `device`) over every rank, the same on all (training/numerics.py
        decides with it)."""
        ...

    def gather_objects(self, value) -> list:
        """`value` (any picklable object) of every rank, in rank order, on every rank (a collective on FSDP2 ranks)."""
        ...

    def count_parameters(self, model: torch.nn.Module, trainable: list[torch.nn.Parameter]) -> tuple[int, int]:
        """(the model's parameters, the `trainable` ones), whole-model counts (a collective on FSDP2 ranks)."""
        ...

    def full_state_dict(self, model: torch.nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The model's whole (unsharded) state dict, or its tensors of `names`."""
        ...

    def state_names(self, model: torch.nn.Module) -> list[str]:
        """The names of the model's whole state dict (on FSDP2 ranks at pp > 1: every stage's)."""
        ...

    def save_pretrained(self, model: torch.nn.Module, path: Path) -> None: ...

    def save_adapter(self, model: torch.nn.Module, peft: torch.nn.Module, path: Path) -> None: ...

    def save_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None: ...

    def load_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None: ...

    def shutdown(self) -> None: ...


class LocalStrategy:
    """The whole model in this process, on `training.device` (a quantized base stays where it was loaded)."""

    is_main, rank, world_size, pipelined = True, 0, 1, False

    def __init__(self):
        self.device = torch.device("cpu")
        self.config: TrainingConfig | None = None

    def setup(self, training: TrainingConfig) -> TrainingConfig:
        parallel = ParallelConfig() if training.parallel == "auto" else training.parallel
        parallel = parallel.resolved(1)  # one rank: a one-line error for tp or cp > 1
        self.config = training.model_copy(update={"parallel": parallel})
        self.device = resolve_device(training.device, "training.device")
        return self.config

    def load_config(self, model_config: ModelConfig) -> ModelConfig:
        return model_config

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        if getattr(model, "is_quantized", False):  # bitsandbytes' 4-bit base is placed by its loader
            self.device = next(model.parameters()).device
            return model
        return model.to(self.device)

    def micro_batches(self, batch: TrainBatch, plan: Plan) -> Iterator[MicroBatch]:
        for rows in plan(batch.attention_mask.sum(dim=1).tolist(), Prompts.of(batch, self.config)):
            micro, local_rows, indices = select_micro_batch(batch, rows)
            yield indices, batch_to(micro, self.device), local_rows

    def passes(self, model: torch.nn.Module, batch: TrainBatch, plan: Plan, loss: MicroLoss, backward: bool) -> None:
        run_passes(self.micro_batches(batch, plan), loss, backward)

    def per_token(self, batch: TrainBatch, plan: Plan, compute: Compute, model=None) -> torch.Tensor:
        out = torch.zeros_like(batch.loss_mask)
        for indices, micro, rows in self.micro_batches(batch, plan):
            values_BT = compute(micro, rows)
            out[indices, : values_BT.shape[1]] = values_BT.to(out.device)
        return out * batch.loss_mask

    def clip_gradients(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        return {name: float(value) for name, value in (totals | extremes).items()}

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def gather_objects(self, value) -> list:
        return [value]

    def count_parameters(self, model: torch.nn.Module, trainable: list[torch.nn.Parameter]) -> tuple[int, int]:
        return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trainable)

    def full_state_dict(self, model: torch.nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        state_dict = model.state_dict()
        return state_dict if names is None else {name: state_dict[name] for name in names}

    def state_names(self, model: torch.nn.Module) -> list[str]:
        return list(model.state_dict())

    def save_pretrained(self, model: torch.nn.Module, path: Path) -> None:
        model.save_pretrained(path)

    def save_adapter(self, model: torch.nn.Module, peft: torch.nn.Module, path: Path) -> None:
        peft.save_pretrained(path)

    def save_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
        """The checkpoint format of every layout (training/state.py), written by this process alone."""
        state.save_state(model, optimizer, scheduler, path, adapter_only, is_main=True)

    def load_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
        """A checkpoint of any layout, or a one-process `state.pt` of the format before it."""
        state.load_state(model, optimizer, scheduler, path, adapter_only)

    def shutdown(self) -> None:
        pass
