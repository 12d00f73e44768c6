"""`ppo`: the settings of PPO with a critic (algorithms/ppo.py has the step, ppo_losses.py its math), and
`PPORunConfig`, the tree of a `reinforge ppo` run: the RL loop's sections (algorithms/rl_config.py) plus `ppo` and
`overlong` (shaping.py), so a PPO config never carries GRPO's advantage settings nor a GRPO config PPO's: each
recipe refuses the other's as unknown keys.

Defaults against the two reference implementations (their shipped configs: NeMo-RL's
examples/configs/ppo_math_1B.yaml, veRL's trainer/config/algorithm.py and critic/critic.yaml):

| setting              | here  | NeMo-RL                              | veRL                      |
|----------------------|-------|--------------------------------------|---------------------------|
| gamma                | 1.0   | 1.0 (adv_estimator.gae_gamma)        | 1.0 (algorithm.gamma)     |
| lam                  | 0.95  | 0.95 (adv_estimator.gae_lambda)      | 1.0 (algorithm.lam)       |
| value_clip           | 0.2   | 0.2 (value_loss_fn.cliprange)        | 0.5 (critic.cliprange_value) |
| critic_lr            | 1e-5  | 1e-5 (value.optimizer, DTensor)      | 1e-5 (critic.optim.lr)    |
| critic_epochs        | 1     | ppo_epochs (4 in ppo_math_1B)        | ppo_epochs (1)            |
| critic_warmup_steps  | 0     | 0 (policy_training_start_step)       | 0 (trainer.critic_warmup) |
| critic_first         | true  | critic before actor                  | critic before actor       |
| whiten_advantages    | true  | true (normalize_advantages)          | always (masked_whiten)    |
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from reinforge.algorithms.policy_loss import RewardKLLossConfig
from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.algorithms.shaping import OverlongConfig, check_overlong
from reinforge.config.section import Section
from reinforge.logging.loggers import LoggingConfig


class PPOConfig(Section):
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per action (generated token). 1: the reward at the end counts fully at every token, as for
    outcome rewards in NeMo-RL and veRL."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE's lambda: 1 gives Monte-Carlo advantages R - V(s_t) (veRL's default), 0 one-step TD errors; NeMo-RL's
    0.95 trades a little bias for less variance."""
    value_clip: float | None = Field(default=0.2, gt=0)
    """eps_v of the clipped value loss: a new value counts as at most this far from the rollout's value where
    that is the larger loss (NeMo-RL 0.2, veRL 0.5); null: the plain squared error."""
    critic_lr: float = Field(default=1e-5, gt=0)
    """The critic's AdamW learning rate (its other optimizer settings are `optimizer.*`'s)."""
    critic_epochs: int = Field(default=1, ge=1)
    """Passes of the critic over each rollout batch (each pass one optimizer step per global batch; NeMo-RL's
    critic_ppo_epochs). Its value clipping keeps every pass near the rollout's values."""
    critic_warmup_steps: int = Field(default=0, ge=0)
    """Steps that train only the critic (the policy is not updated, nor refitted) before the actor starts."""
    critic_first: bool = True
    """Update the critic before the actor in each step (NeMo-RL's and veRL's order). Both learn from the same
    rollout values and advantages, so the order changes no number; it sets which model's update runs first."""
    whiten_advantages: bool = True
    """Normalise the advantages to mean 0, std 1 over all valid tokens of the step's batch (the Bessel-corrected
    std, eps 1e-8 inside the square root, as veRL and NeMo-RL: ppo_losses.whiten_tokens)."""


class PPORunConfig(RLRunConfig):
    """A whole `reinforge ppo` run: the RL loop's sections, PPO's critic and GAE, and DAPO's overlong shaping (no
    `grpo` section: PPO's advantages are GAE's, not group-relative)."""

    recipe: ClassVar[str] = "ppo"
    ppo: PPOConfig = PPOConfig()
    """The critic, GAE and the order of the two updates."""
    overlong: OverlongConfig = OverlongConfig()
    """DAPO's overlong reward shaping and filtering (the critic learns the shaped rewards too)."""
    loss: RewardKLLossConfig = RewardKLLossConfig()
    """The actor's clipped policy-gradient loss, its KL penalty (in the loss or, InstructGPT's way, the reward)."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/ppo")
    """Run directory (config.yaml, metrics.jsonl, checkpoints/, final/) and console output."""

    @property
    def num_trained_models(self) -> int:
        """The policy and the critic."""
        return 2

    @model_validator(mode="after")
    def _check_ppo(self) -> "PPORunConfig":
        """What PPO does not do yet."""
        check_overlong(self.overlong, self.generation.max_new_tokens, self.rollout.max_turns)
        if self.model.lora is not None:
            raise ValueError(
                "reinforge ppo does not train LoRA adapters yet (the critic is a full model); set model.lora=null"
            )
        if self.rollout.mode != "sync":
            raise ValueError(f"reinforge ppo is on-policy only; rollout.mode={self.rollout.mode}: set it to sync")
        return self
