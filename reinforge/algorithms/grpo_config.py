"""`grpo`: GRPO's settings (algorithms/grpo.py has the step, grpo_losses.py its advantages), and `GRPORunConfig`, the
tree of a `reinforge grpo` run: the RL loop's sections (algorithms/rl_config.py) plus `grpo`, `overlong` and the
`loss` whose KL penalty may sit in the reward."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from reinforge.algorithms.policy_loss import RewardKLLossConfig
from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.algorithms.shaping import OverlongConfig, check_overlong
from reinforge.config.loader import load_recipe_config
from reinforge.config.section import Section


class GRPOConfig(Section):
    """`grpo:` GRPO's group-relative advantages and the choices of its family (RLOO, Dr.GRPO, REINFORCE++, GDPO,
    DAPO's dynamic sampling)."""

    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group baseline: the group mean, or the mean of the other samples (RLOO)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward standard deviation (GRPO); false for Dr.GRPO."""
    whiten_advantages: bool = False
    """After the group baseline, normalise the advantages by the mean and standard deviation of the whole
    batch, all groups together (REINFORCE++'s global advantage normalisation)."""
    whiten_over: Literal["tokens", "sequences"] = "tokens"
    """What the batch whitening (and GDPO's) averages over: every valid token, each carrying its sequence's
    advantage (REINFORCE++'s paper and reference implementations), or each sequence once."""
    decoupled_normalization: bool = False
    """GDPO (arXiv:2601.05242): normalise each reward component within its group, sum them with their weights,
    then whiten the sum over the batch, instead of normalising the summed reward. The components are the
    task reward and each of `env.extra_rewards` (with their weights), or else an agent's `reward_components`
    when they sum to its reward; a trajectory without them is one component (GRPO, whitened)."""
    skip_zero_advantage: bool = True
    """Leave sequences whose advantage is exactly 0 (groups whose rewards are all equal), and those with no
    token to train on (overlong filtering), out of the training pass when `loss.kl_coef` is 0: their loss
    is 0 whatever the policy, so they add nothing to the gradient.
    The loss still divides by the whole batch's counts, so the update is the same (up to float summation
    order); metric means (entropy, clip fraction, mismatch) are then over the sequences trained on."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (they have no advantage) and roll out
    further batches of `rollout.num_prompts_per_step` prompts until that many groups remain; the surplus is
    discarded."""
    dynamic_sampling_max_extra_rounds: int = Field(default=4, ge=0)
    """Most extra rollout rounds per step under dynamic sampling; when they are used up the step trains on
    the groups it has (fewer than `rollout.num_prompts_per_step`; none: the step is skipped)."""

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        if self.decoupled_normalization and self.whiten_advantages:
            raise ValueError(
                "grpo.decoupled_normalization (GDPO) already whitens the advantages over the batch; "
                "set grpo.whiten_advantages=false"
            )
        return self


class GRPORunConfig(RLRunConfig):
    """A whole `reinforge grpo` run: the RL loop's sections, GRPO's advantages and DAPO's overlong shaping."""

    recipe: ClassVar[str] = "grpo"
    grpo: GRPOConfig = GRPOConfig()
    """Group-relative advantages, the family's variants, dynamic sampling."""
    overlong: OverlongConfig = OverlongConfig()
    """DAPO's overlong reward shaping and filtering."""
    loss: RewardKLLossConfig = RewardKLLossConfig()
    """The clipped policy-gradient loss, its KL penalty (in the loss or the reward) and mismatch correction."""

    @model_validator(mode="after")
    def _check_grpo(self) -> "GRPORunConfig":
        check_overlong(self.overlong, self.generation.max_new_tokens, self.rollout.max_turns)
        ranks, group = self.training.num_workers, self.rollout.num_generations_per_prompt
        if self.grpo.dynamic_sampling and self.training.backend == "fsdp2" and group % ranks:
            raise ValueError(
                f"grpo.dynamic_sampling=true with training.num_workers={ranks}: a step may train on fewer groups, "
                f"and a batch of whole groups of rollout.num_generations_per_prompt={group} must split evenly over "
                "the ranks; make num_generations_per_prompt a multiple of training.num_workers"
            )
        return self


def load_config(path: str | Path | None, overrides: list[str] = ()) -> GRPORunConfig:
    """A GRPO run's config from an optional YAML file plus `key=value` overrides."""
    return load_recipe_config(GRPORunConfig, path, overrides)
