"""GRPO with verifiable rewards (`reinforge grpo`): the step of a recipe of the RL loop (loops/rl_loop.py runs it;
its settings are grpo_config.py's, its advantages grpo_losses.py's).

Each step, on the loop's scored groups (G answers to each of P prompts): DAPO's overlong shaping of the rewards;
the reference (and, with several optimizer steps per rollout, the old) logprobs from the trainer; group-relative
advantages; one clipped policy-gradient optimizer step per global batch of the rollout. The loop then refits the
engine, validates, logs and checkpoints.

As implemented, relative to GRPO (Shao et al. 2024, arXiv:2402.03300):
1. The loss is aggregated per token over the whole global batch by default (DAPO, arXiv:2503.14476),
   not per sequence then per group; `loss.aggregation=sequence` gives the paper's form.
2. The KL penalty (k3) is in the loss, as in the paper, but off by default (`loss.kl_coef=0`) and then
   the reference model is not even loaded.
3. Clip bounds may be asymmetric (`clip_eps_high`, DAPO's clip-higher) and dual clip is optional.
4. The old logprobs come from the trainer, not the generation engine, so the ratio is exactly 1 on
   the first optimizer step; the engine's logprobs are kept to measure train/inference mismatch. Those of the
   first global batch are its training pass's own; only later global batches' need a pass (`loss.old_logprobs`).

The GRPO family are settings of this recipe (configs/*_demo.yaml, docs/algorithms.md): DAPO (dynamic sampling,
overlong reward shaping and filtering, clip-higher, token-level loss), GSPO (sequence-level ratio), Dr.GRPO (no
std division, constant normaliser), RLOO (leave-one-out baseline), REINFORCE++ (batch-whitened advantages),
CISPO (clipped, detached importance weights), GDPO (rewards normalised per component).
"""

from __future__ import annotations

from functools import partial

import torch

from reinforge.algorithms.consistency import version_matched_mismatch
from reinforge.algorithms.dynamic_sampling import fill_with_informative_groups
from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.algorithms.grpo_losses import kl_reward_penalties, step_advantages
from reinforge.algorithms.learner import Learner, LearnerParts, StepResult
from reinforge.algorithms.policy_loss import kl_in_reward, old_policy_logprobs, policy_loss_fn, split_old_logprobs
from reinforge.algorithms.shaping import overlong_penalties
from reinforge.algorithms.step_metrics import (
    advantage_metrics,
    rollout_metrics,
    step_rewards,
    token_advantage_metrics,
    train_metrics,
)
from reinforge.data.batch import Normalisers, TrainBatch, collate
from reinforge.logging.metrics import Timers
from reinforge.rollout.source import RolloutBatch
from reinforge.training.base import TrainingBackend


def grpo_learner(config: GRPORunConfig, parts: LearnerParts) -> Learner:
    """Group-relative advantages and the clipped policy-gradient loss; DAPO's dynamic sampling when asked."""
    grpo, rollout = config.grpo, config.rollout
    loss_fn = policy_loss_fn(config.loss, config.generation.max_new_tokens, config.off_policy)
    step = partial(train_on_batch, trainer=parts.trainer, tokenizer=parts.tokenizer, loss_fn=loss_fn, config=config)
    collect = None
    if grpo.dynamic_sampling:
        collect = partial(
            fill_with_informative_groups,
            num_groups=rollout.num_prompts_per_step,
            group_size=rollout.num_generations_per_prompt,
            max_extra_rounds=grpo.dynamic_sampling_max_extra_rounds,
        )
    return Learner("GRPO", step, collect_groups=collect)


def train_on_batch(
    step: int, rollout_batch: RolloutBatch, timers: Timers, *, trainer: TrainingBackend, tokenizer, loss_fn, config
) -> StepResult:
    """Advantages, logprobs and the optimizer steps on one step's rollout batch."""
    global_batch, loss, overlong = config.training.global_batch_size, config.loss, config.overlong
    rewards_PG, metrics = step_rewards(step, rollout_batch, config.rollout.num_generations_per_prompt)
    if rewards_PG is None:  # dynamic sampling found no group with unequal rewards: nothing to learn from
        return StepResult(metrics, trained=False)
    trajectories = rollout_batch.trajectories
    penalties_PG = overlong_penalties(trajectories, overlong, config.generation.max_new_tokens).view_as(rewards_PG)
    batch = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    if overlong.filtering:  # DAPO: truncated answers are not trained on (their rewards still set the baseline)
        batch.loss_mask *= torch.tensor([[0.0 if t.truncated else 1.0] for t in trajectories])

    with timers.time("logprobs"):  # else the loss takes the training pass's as the old policy's
        # rollout.version_check compares each token's sampling version with this pass (and the kept versions')
        check = config.rollout.mode != "sync" and config.rollout.version_check
        whole = loss.old_logprobs == "recompute" or loss.kl_in_reward or check
        old_from = old_policy_logprobs(trainer, batch, global_batch, whole)
        if loss.kl_coef > 0:
            batch.ref_logprobs = trainer.logprobs(batch, reference=True)
    if config.rollout.mode != "sync" and old_from == 0:
        with timers.time("version_check"):  # each token against the version that sampled it
            kept = trainer.keep_version(step - 1, config.rollout.max_staleness + 1) if check else []
            metrics |= version_matched_mismatch(batch, trajectories, step - 1, trainer, kept)
    kl_penalties_PG = -kl_reward_penalties(batch, loss).view_as(rewards_PG)  # loss.kl_in_reward
    shaping = [
        term for term, on in ((penalties_PG, overlong.buffer_tokens > 0), (kl_penalties_PG, loss.kl_in_reward)) if on
    ]
    advantages_PG, advantage_parts = step_advantages(
        trajectories, rewards_PG, shaping, batch, config.grpo, config.env.extra_rewards
    )
    batch.advantages = advantages_PG.flatten().unsqueeze(1) * batch.loss_mask  # each sequence's on its tokens
    with timers.time("train"):  # one optimizer step per global batch of the rollout that has tokens to train on
        global_batches = split_old_logprobs(batch, global_batch, old_from)
        updates = [
            trainer.train_step(computed_part(b, config), loss_fn, step) for b in global_batches if b.num_valid_tokens()
        ]
    return StepResult(
        {
            **metrics,
            **rollout_metrics(trajectories, rewards_PG),
            **advantage_metrics(trajectories, penalties_PG, advantages_PG, overlong),
            **token_advantage_metrics(batch, kl_penalties_PG, kl_in_reward(loss)),
            **advantage_parts,
            **train_metrics(updates),  # the engine/trainer mismatch (train/token_mult_prob_error, ...) among them
        },
        trained=bool(updates),
        num_tokens=int(batch.attention_mask.sum()),
    )


def computed_part(batch: TrainBatch, config: GRPORunConfig) -> TrainBatch:
    """A global batch without the sequences that add nothing to its loss (`grpo.skip_zero_advantage`):
    with no KL term in the loss a zero-advantage sequence's loss is 0 whatever the policy, and so is that of a
    sequence with no token to train on (DAPO's overlong filtering). The part keeps the whole batch's
    normalisers, so its gradient is the batch's. The part is topped up with the shortest of the others
    (adding 0) to a whole number of sequences per training rank, at least one each: FSDP2 ranks take
    equal shares, and the optimizer step still runs when nothing is left (AdamW's moments move the
    weights even on a zero gradient)."""
    if not config.grpo.skip_zero_advantage or (config.loss.kl_coef > 0 and not config.loss.kl_in_reward):
        return batch
    keep = ((batch.advantages != 0).any(dim=1) & (batch.loss_mask.sum(dim=1) > 0)).nonzero().flatten().tolist()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    fillers = sorted(set(range(len(batch))) - set(keep), key=lambda i: (lengths[i], i))
    ranks = config.training.num_workers
    keep = sorted(keep + fillers[: max(ranks, -(-len(keep) // ranks) * ranks) - len(keep)])
    if len(keep) == len(batch):
        return batch
    part = batch.select(keep)
    part.loss_normalisers = Normalisers(
        num_tokens=batch.num_valid_tokens(), num_sequences=len(batch), num_computed_tokens=part.num_valid_tokens()
    )
    return part
