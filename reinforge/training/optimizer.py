"""`optimizer:` and `scheduler:`, and the AdamW + learning-rate schedule that every training backend builds from them.

Apart from the backends' settings (`training:`: packing, micro-batches, FSDP2) because a recipe may train two models
with one backend configuration but different optimizers (PPO's critic has its own learning rate).
"""

from __future__ import annotations

from typing import Iterable, Literal

import torch
from pydantic import Field
from transformers import get_scheduler

from reinforge.config.section import Section

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


class OptimizerConfig(Section):
    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each step; 0 disables clipping."""


class SchedulerConfig(Section):
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warm-up from 0 to `optimizer.lr`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warm-up, over all optimizer steps of the run."""


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerConfig,
    scheduler: SchedulerConfig,
    num_optimizer_steps: int,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its warm-up + schedule over the run's optimizer steps (shared by every backend)."""
    adamw = torch.optim.AdamW(
        parameters,
        lr=optimizer.lr,
        betas=(optimizer.adam_beta1, optimizer.adam_beta2),
        eps=optimizer.adam_eps,
        weight_decay=optimizer.weight_decay,
    )
    schedule = get_scheduler(
        SCHEDULES[scheduler.lr_schedule],
        adamw,
        num_warmup_steps=scheduler.warmup_steps,
        num_training_steps=max(num_optimizer_steps, 1),
    )
    return adamw, schedule


def clip_norm(optimizer: OptimizerConfig) -> float:
    """The gradient-norm bound of `optimizer.max_grad_norm` (0: no clipping)."""
    return optimizer.max_grad_norm if optimizer.max_grad_norm > 0 else float("inf")
