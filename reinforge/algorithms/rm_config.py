"""`reinforge rm`'s settings: its root config (`RMRunConfig`) and its section `rm` (the recipe is rm.py)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from reinforge.algorithms.pairs import PairRunConfig
from reinforge.algorithms.supervised_recipe import StepsConfig
from reinforge.logging.loggers import LoggingConfig


class RewardModelTrainingConfig(StepsConfig):
    max_steps: int = Field(default=200, ge=0)
    """Optimizer steps; each takes training.global_batch_size / 2 pairs, the data recycled epoch after epoch."""
    val_every: int = Field(default=20, ge=0)
    """Validate on the held-out pairs every this many steps (and before the first and after the last); 0: only then."""


class RMRunConfig(PairRunConfig):
    """A whole `reinforge rm` run."""

    recipe: ClassVar[str] = "rm"

    rm: RewardModelTrainingConfig = RewardModelTrainingConfig()
    """The reward-model schedule."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/rm")
    """Run directory (config.yaml, metrics.jsonl, final/) and console output."""

    @model_validator(mode="after")
    def _check_rm(self) -> "RMRunConfig":
        if self.model.lora and self.training.backend == "fsdp2":  # FSDP2's adapter export keeps `.lora_` keys only
            raise ValueError(
                "model.lora with training.backend=fsdp2 is not supported by rm yet (the ranks' adapter export leaves "
                "out the new score head); set training.backend=torch or model.lora=null"
            )
        return self
