"""The seam between the supervised loop (loops/supervised.py) and its recipes (sft.py, dpo.py, rm.py): the sections
every supervised run shares (`SupervisedRunConfig`) and what a recipe hands the loop (a `SupervisedRecipe`: its
examples, its model's head, and each global batch of examples as a training batch with its loss).

The loop draws the examples, steps the optimizer, validates, logs, checkpoints and resumes; it never branches on
which recipe it runs. A recipe is a file with a root config (a `SupervisedRunConfig` plus its `data`, `training`,
`logging` and its own section, a `StepsConfig`) and a `SupervisedRecipe` subclass made from that config and the
tokenizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, model_validator

from reinforge.cluster.config import TrainerClusterConfig
from reinforge.config.section import Section
from reinforge.data.batch import TrainBatch
from reinforge.hang import TrainerDeadlinesConfig
from reinforge.logging.metrics import Timers
from reinforge.model_config import ModelConfig
from reinforge.training.base import LossFn
from reinforge.training.checkpoint import CheckpointConfig
from reinforge.training.heads import Head
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig


class StepsConfig(Section):
    """How long a supervised recipe trains and when it validates (its own section adds its settings)."""

    max_steps: int = Field(default=100, ge=0)
    """Optimizer steps, each on `training.global_batch_size` sequences; the data recycled epoch after epoch."""
    val_every: int = Field(default=50, ge=0)
    """Validate on the held-out set every this many steps (and before the first and after the last); 0: only then."""


class SupervisedRunConfig(Section):
    """What every supervised run has: the model, its optimizer and schedule, checkpoints, deadlines, the cluster of
    its training ranks. Not a run on its own: a recipe's root adds `data`, `training` (a `BackendConfig`), `logging`
    and its own section (named as the recipe, a `StepsConfig`)."""

    recipe: ClassVar[str] = ""
    # keys of earlier versions and where they are now, for the unknown-key error
    moved_keys: ClassVar[dict[str, str]] = {"num_threads": "cluster.num_threads"}

    seed: int = 0
    """Seed for the validation split, the data order and any freshly initialised weights."""
    model: ModelConfig = ModelConfig()
    """The model to start from and its tokenizer."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The learning-rate schedule over the recipe's max_steps."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints every `save_every` steps (weights, optimizer, data position, RNG, step), `resume=auto` to continue
    from the newest, and whether to write the trained model to RUN_DIR/final."""
    deadlines: TrainerDeadlinesConfig = TrainerDeadlinesConfig()
    """The step watchdog and the longest a checkpoint may take."""
    cluster: TrainerClusterConfig = TrainerClusterConfig()
    """torch's threads; automatic restarts (`max_restarts`); with `training.backend=fsdp2`, the Ray cluster the ranks
    run on and each rank's resources."""

    @property
    def steps(self) -> StepsConfig:
        """The recipe's own section: its step count and validation interval."""
        return getattr(self, self.recipe)

    @model_validator(mode="after")
    def _check_supervised(self) -> "SupervisedRunConfig":
        # the backend's own rules (ranks and cpu_offload need fsdp2) are the training section's (training/base.py)
        if self.model.lora and self.model.lora.quantize_base != "none":
            raise ValueError(f"model.lora.quantize_base (QLoRA) is not supported by {self.recipe}; set it to none")
        if self.logging.console_every < 1:
            raise ValueError("logging.console_every must be >= 1")
        return self


@dataclass
class RecipeModel:
    """What the loop's training backend computes for a recipe (loops/builders.py, `build_recipe_backend`): the head
    on the model; `rows_together`: rows of a batch that must stay on one rank (a preference pair's two);
    `row_tokens`: the width of a packed row (None: a micro-batch's longest sequence); `load_reference`: keep a frozen
    copy of the starting model."""

    head: Head
    rows_together: int = 1
    row_tokens: int | None = None
    load_reference: bool = False


class SupervisedRecipe(ABC):
    """A supervised recipe as the loop sees it. `examples`: the training examples, which the loop's seeded sampler
    draws `examples_per_step` at a time (by index); `num_val`: held-out examples (0: no validation); `model`: what
    the backend computes; `summary`: the `val/` metrics compared at the end of a run."""

    title: ClassVar[str] = ""
    summary: ClassVar[tuple[str, ...]] = ("loss",)

    def __init__(self, examples: list[Any], num_val: int, examples_per_step: int, model: RecipeModel):
        self.examples, self.num_val, self.examples_per_step, self.model = examples, num_val, examples_per_step, model

    def start(self, backend) -> None:
        """Called once the backend holds the starting model, before a checkpoint is restored into it (DPO's
        reference logprobs are the starting model's)."""

    @abstractmethod
    def train_batch(self, indices: list[int], timers: Timers) -> tuple[TrainBatch, LossFn]:
        """The training batch of examples `indices` and its loss, normalised over the whole global batch."""

    @abstractmethod
    def val_batch(self) -> tuple[TrainBatch, LossFn]:
        """The held-out examples as one batch and the loss whose metrics are the `val/` ones."""
