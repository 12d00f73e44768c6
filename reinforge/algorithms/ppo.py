"""PPO with a critic (`reinforge ppo`): the step of a recipe of the RL loop, read top to bottom (its settings are
ppo_config.py's, its math ppo_losses.py's).

The loop (loops/rl_loop.py: sample, score, train, refit, validate, log, checkpoint) is shared; what a
step does with its rollouts is this file's `train_on_batch`:
collate; the trainer's old (and reference) logprobs; the critic's values V(s_t) on every generated token
(training/critic.py: a value head on its own copy of the base model); token rewards (the environment's
reward on the last generated token); GAE advantages and returns per token (algorithms/ppo_losses.py);
advantages whitened over the batch's tokens; the critic's optimizer steps on the clipped value loss;
the actor's on the clipped policy-gradient loss (policy_loss.py) with the per-token advantages; metrics. During the
first `ppo.critic_warmup_steps` steps only the critic trains (and the engine is not refitted).

Why a recipe (`reinforge ppo`) rather than `grpo.advantage=gae`: PPO brings a second trained model, with
its own optimizer, learning rate, warm-up and checkpoint, and a step of a different shape (values, GAE, two
updates); a switch inside GRPO's step would thread all of that through the group-advantage code. Here GRPO's
step stays as it was, and PPO shares the clipped loss, the step metrics and the loop with it (the `Learner` seam).

As implemented, relative to PPO for language models (Ouyang et al. 2022, arXiv:2203.02155, after Ziegler et
al. 2019 and Schulman et al. 2017):
1. The KL to the reference is a loss term (`loss.kl_coef`, `loss.kl_estimator`, as in GRPO) by default; with
   `loss.kl_in_reward` it is InstructGPT's per-token reward penalty -kl_coef * KL_t instead (of the rollout
   policy against the reference, not differentiated), which the critic then learns to predict too.
2. The policy's old logprobs come from the trainer; the first global batch's are its training pass's own (as in
   GRPO, `loss.old_logprobs`); one pass over the rollout (no PPO epochs).
3. The critic is its own copy of the base model with a zero-initialised value head (no reward-model
   initialisation), on the policy's training backend: in this process (torch), or with FSDP2 on
   `training.num_workers` ranks of its own beside the policy's (cluster/fsdp2_trainer.py).
4. The samples of a prompt are still drawn in groups (`rollout.num_generations_per_prompt`, at least 2), which
   PPO does not need; the group plays no part in the advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial

import torch

from reinforge.algorithms.learner import Learner, LearnerParts, StepResult
from reinforge.algorithms.losses import KL_ESTIMATORS
from reinforge.algorithms.policy_loss import kl_in_reward, old_policy_logprobs, policy_loss_fn, split_old_logprobs
from reinforge.algorithms.ppo_config import PPORunConfig
from reinforge.algorithms.ppo_losses import (
    clipped_value_loss,
    explained_variance,
    gae,
    masked_mean_std,
    terminal_rewards,
    whiten_tokens,
)
from reinforge.algorithms.shaping import overlong_penalties
from reinforge.algorithms.step_metrics import (
    rollout_metrics,
    step_rewards,
    token_advantage_metrics,
    train_metrics,
)
from reinforge.data.batch import TrainBatch, collate
from reinforge.logging.metrics import Timers
from reinforge.rollout.source import RolloutBatch
from reinforge.training.base import TrainingBackend


@dataclass
class CriticBatch(TrainBatch):
    """A training batch with what the critic regresses on."""

    old_values: torch.Tensor | None = None  # [B, T]: the critic's V(s_t) on the rollout, before this step's updates
    returns: torch.Tensor | None = None  # [B, T]: GAE's returns A_t + V(s_t), the value targets


def ppo_learner(config: PPORunConfig, parts: LearnerParts) -> Learner:
    """The critic (its own copy of the base model, built by the loop on the policy's training backend, with AdamW
    at `ppo.critic_lr`, saved as `critic/` in every checkpoint) and PPO's step."""
    critic = parts.build_critic(config.optimizer.model_copy(update={"lr": config.ppo.critic_lr}))
    step = partial(
        train_on_batch,
        trainer=parts.trainer,
        critic=critic,
        tokenizer=parts.tokenizer,
        loss_fn=policy_loss_fn(config.loss, config.generation.max_new_tokens, off_policy=False),
        value_loss_fn=make_value_loss_fn(config.ppo.value_clip),
        config=config,
    )
    return Learner("PPO", step, models={"critic": critic})


def make_value_loss_fn(clip: float | None):
    def value_loss_fn(values_BT: torch.Tensor, micro: CriticBatch, norm):
        return clipped_value_loss(values_BT, micro.old_values, micro.returns, micro.loss_mask, norm, clip)

    return value_loss_fn


def train_on_batch(
    step: int,
    rollout_batch: RolloutBatch,
    timers: Timers,
    *,
    trainer: TrainingBackend,
    critic: TrainingBackend,
    tokenizer,
    loss_fn,
    value_loss_fn,
    config: PPORunConfig,
) -> StepResult:
    """Values, GAE, the critic's and the actor's optimizer steps on one step's rollout batch. Returns its
    metrics and whether the policy changed (not during the critic's warm-up)."""
    ppo, global_batch = config.ppo, config.training.global_batch_size
    rewards_PG, metrics = step_rewards(step, rollout_batch, config.rollout.num_generations_per_prompt)
    if rewards_PG is None:  # nothing to learn from
        return StepResult(metrics, trained=False)
    trajectories = rollout_batch.trajectories
    penalties_PG = overlong_penalties(trajectories, config.overlong, config.generation.max_new_tokens).view_as(
        rewards_PG
    )
    collated = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    batch = CriticBatch(**{f.name: getattr(collated, f.name) for f in fields(collated)})
    if config.overlong.filtering:  # DAPO: truncated answers are trained on by neither model
        batch.loss_mask *= torch.tensor([[0.0 if t.truncated else 1.0] for t in trajectories])
    actor_trains, loss = step > ppo.critic_warmup_steps, config.loss

    with timers.time("logprobs"):  # the KL penalty in the reward is the critic's target too, warm-up or not
        whole = loss.kl_in_reward or (actor_trains and loss.old_logprobs == "recompute")
        old_from = old_policy_logprobs(trainer, batch, global_batch, whole) if actor_trains or whole else None
        if loss.kl_coef > 0 and (actor_trains or loss.kl_in_reward):
            batch.ref_logprobs = trainer.logprobs(batch, reference=True)
    with timers.time("values"):
        batch.old_values = critic.values(batch)
    rewards_BT = terminal_rewards((rewards_PG + penalties_PG).flatten(), batch.loss_mask)
    kl_penalties_BT = torch.zeros_like(rewards_BT)
    if loss.kl_in_reward:  # InstructGPT's per-token penalty: r_t = -kl_coef * KL_t, plus the reward on the last token
        kl_penalties_BT = (
            loss.kl_coef * KL_ESTIMATORS[loss.kl_estimator](batch.old_logprobs, batch.ref_logprobs) * batch.loss_mask
        )
        rewards_BT = rewards_BT - kl_penalties_BT
    advantages_BT, batch.returns = gae(rewards_BT, batch.old_values, batch.loss_mask, ppo.gamma, ppo.lam)
    batch.advantages = whiten_tokens(advantages_BT, batch.loss_mask) if ppo.whiten_advantages else advantages_BT

    global_batches = [b for b in split_old_logprobs(batch, global_batch, old_from) if b.num_valid_tokens()]

    def critic_updates() -> list[dict[str, float]]:
        with timers.time("critic_train"):
            return [critic.train_step(b, value_loss_fn, step) for _ in range(ppo.critic_epochs) for b in global_batches]

    def actor_updates() -> list[dict[str, float]]:
        with timers.time("train"):
            return [trainer.train_step(b, loss_fn, step) for b in global_batches] if actor_trains else []

    if ppo.critic_first:
        critic_stats, actor_stats = critic_updates(), actor_updates()
    else:
        actor_stats = actor_updates()
        critic_stats = critic_updates()
    critic_metrics = {
        name.replace("train/", "train/critic_") if not name.startswith("train/value") else name: value
        for name, value in train_metrics(critic_stats).items()
    }
    return StepResult(
        {
            **metrics,
            **rollout_metrics(trajectories, rewards_PG),
            **value_metrics(batch, advantages_BT),
            # the whitened advantages, which the actor trains on
            **token_advantage_metrics(batch, -kl_penalties_BT.sum(dim=1), kl_in_reward(loss)),
            **critic_metrics,
            **train_metrics(actor_stats),  # the engine/trainer mismatch among them
        },
        trained=bool(actor_stats),
        num_tokens=int(batch.attention_mask.sum()),
    )


def value_metrics(batch: CriticBatch, advantages_BT: torch.Tensor) -> dict[str, float]:
    """The rollout's values, returns and (unwhitened) advantages over its valid tokens, and how much of the
    returns' variance the critic explained before this step's update."""
    mask = batch.loss_mask
    return_mean, return_std = masked_mean_std(batch.returns, mask)
    advantage_mean, advantage_std = masked_mean_std(advantages_BT, mask)
    rollout_value_mean, _ = masked_mean_std(batch.old_values, mask)
    return {
        "train/explained_variance": explained_variance(batch.returns, batch.old_values, mask).item(),
        "train/return_mean": return_mean.item(),
        "train/return_std": return_std.item(),
        "train/rollout_value_mean": rollout_value_mean.item(),
        "train/gae_advantage_mean": advantage_mean.item(),
        "train/gae_advantage_std": advantage_std.item(),
    }
