"""`reinforge dpo`'s settings: its root config (`DPORunConfig`) and its section `dpo` (the recipe is dpo.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from reinforge.algorithms.pairs import PairRunConfig
from reinforge.algorithms.supervised_recipe import StepsConfig
from reinforge.logging.loggers import LoggingConfig


class DPOConfig(StepsConfig):
    beta: float = 0.1
    """beta of DPO: implicit rewards are beta * (log pi - log pi_ref) of each reply; a larger beta holds
    the policy closer to the reference."""
    sft_weight: float = 0.0
    """Weight of the chosen replies' mean per-token negative log-likelihood added to the loss (RPO); 0: plain DPO."""
    reference: Literal["per_batch", "precompute"] = "per_batch"
    """`per_batch`: a frozen copy of the starting model computes each batch's reference logprobs;
    `precompute`: the starting policy computes them for every training pair once, before the first
    update, so no second model is kept in memory (worth it from about one epoch of training on). With
    `model.lora` neither keeps a copy: the reference is the policy with its adapters disabled."""
    val_every: int = Field(default=10, ge=0)
    """Validate on the held-out pairs every this many steps (and before the first and after the last); 0: only then."""


class DPORunConfig(PairRunConfig):
    """A whole `reinforge dpo` run."""

    recipe: ClassVar[str] = "dpo"

    dpo: DPOConfig = DPOConfig()
    """The DPO objective and schedule."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/dpo")
    """Run directory (config.yaml, metrics.jsonl, final/) and console output."""

    @model_validator(mode="after")
    def _check_dpo(self) -> "DPORunConfig":
        if self.dpo.beta <= 0:
            raise ValueError("dpo.beta must be > 0 (typical values 0.01 to 0.5)")
        if self.dpo.sft_weight < 0:
            raise ValueError("dpo.sft_weight must be >= 0 (0 disables the NLL term)")
        return self
