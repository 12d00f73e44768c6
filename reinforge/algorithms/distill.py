"""On-policy distillation (`reinforge distill`): the step of a recipe of the RL loop, a frozen teacher in place of (or
beside) the reward (its settings are distill_config.py's, its losses distill_losses.py's).

Each step: the student samples G answers to each of P prompts (the RL loop's rollout, environments scoring
them as usual); the teacher of each answer's task scores the student's own tokens (training/teacher.py: its
logprob of every sampled token and, for the top-k KL, its top-k ids and logprobs at every position); the
student's logprobs before the update come from the trainer; the student takes the optimizer steps of the
rollout batch with one of two losses (algorithms/distill_losses.py has the formulas and their sources):

- `distill.loss=reverse_kl`: the per-token advantage A_t = kl_coef * (log pi_teacher(y_t) -
  log pi_student(y_t)), discount 0, detached, through the clipped policy loss (algorithms/losses.py: the clipped
  surrogate, `loss.*` as for GRPO). Thinking Machines' "On-Policy Distillation" (2025; Tinker cookbook),
  the on-policy reverse-KL case of GKD (Agarwal et al. 2024, arXiv:2306.13649).
- `distill.loss=topk_kl` (default): kl_coef x the token mean of a forward, reverse or mixed KL over the teacher's top
  `distill.topk` tokens at each position (NeMo-RL's distillation loss, top 64 there), added to GRPO's loss.
  The student's logprobs at the teacher's ids come from its training pass (micro_batching: the same chunked
  LM head, packed or not, on either backend).

With `distill.reward_weight` > 0, reward_weight x GRPO's group advantage of each answer is added on its
tokens (to the per-token advantage, or through GRPO's loss beside the top-k KL); otherwise the reward is
only measured. Several teachers may be mixed, one per task (`distill.teachers[].tasks`).

As implemented, relative to the sources:
1. The student's logprobs in A_t are the trainer's, from a no-gradient pass before the update (Tinker uses
   the sampler's); the engine's are kept to measure the mismatch, as in GRPO. That pass runs even when a
   rollout is one optimizer step (GRPO skips it there).
2. The teacher is a frozen model, never checkpointed (a resumed run loads it again), whole (not sharded),
   in the driver's process or, with `placement=ray`, in a Ray actor of its own (cluster/teacher_group.py).
3. The top-k KL is NeMo-RL's default (`zero_outside_topk=false`): both sides renormalised over the teacher's
   top k (`distill.topk_renormalize`, default true); false: the full-vocabulary probabilities at those ids.
4. Teacher and student must share one tokenizer; a teacher with another is a config error before the run
   starts (no token alignment across vocabularies).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, fields
from functools import partial

import torch

from reinforge.algorithms.advantages import BASELINES, group_advantages
from reinforge.algorithms.distill_config import DistillConfig, DistillRunConfig, TeacherConfig
from reinforge.algorithms.distill_losses import reverse_kl_advantages, topk_kl
from reinforge.algorithms.learner import Learner, LearnerParts, StepResult
from reinforge.algorithms.losses import metric_mean, token_mean
from reinforge.algorithms.policy_loss import policy_loss_fn
from reinforge.algorithms.shaping import valid_samples
from reinforge.algorithms.step_metrics import (
    rollout_metrics,
    step_rewards,
    token_advantage_metrics,
    train_metrics,
)
from reinforge.data.batch import TrainBatch, Trajectory, collate
from reinforge.data.prompt_stream import training_prompts
from reinforge.errors import ConfigError
from reinforge.logging.metrics import Timers
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_processor, load_tokenizer
from reinforge.rollout.source import RolloutBatch
from reinforge.training.base import TrainingBackend
from reinforge.training.heads import LogprobsAt, with_outputs
from reinforge.training.teacher import Teacher


def teacher_model(config: DistillRunConfig, teacher: TeacherConfig) -> ModelConfig:
    """The student's model settings (dtype, remote code) for the teacher's weights, without the student's LoRA or
    adapter."""
    return config.model.model_copy(update={"name_or_path": teacher.name_or_path, "lora": None, "adapter": None})


def check_distill(config: DistillRunConfig) -> None:
    """One-line errors before any run directory: a teacher whose tokenizer is not the student's, a training
    task that no teacher scores (GRPO's reward shaping is not in distillation's tree: unknown keys there)."""
    student = load_tokenizer(config.model)
    for teacher in config.distill.teachers:
        theirs = load_tokenizer(teacher_model(config, teacher))
        if theirs.get_vocab() != student.get_vocab() or theirs.all_special_tokens != student.all_special_tokens:
            raise ConfigError(
                f"distill.teachers: {teacher.name_or_path} has another tokenizer than the student "
                f"{config.model.name_or_path} ({len(theirs)} vs {len(student)} tokens); the teacher scores the "
                "student's token ids, so both must share one tokenizer: pick a teacher of the student's family"
            )
    tasks = {
        p.record.get("task", config.env.default_task)
        for p in training_prompts(config.data, student, load_processor(config.model))
    }
    orphans = sorted(task for task in tasks if config.distill.teacher_of(task) is None)
    if orphans:
        raise ConfigError(
            f"distill.teachers: no teacher scores task {', '.join(orphans)} of {config.data.train_path}; "
            "name it in a teacher's `tasks`, or leave one teacher's `tasks` empty (the default teacher)"
        )


def distill_learner(config: DistillRunConfig, parts: LearnerParts) -> Learner:
    """The teachers (one frozen model per distinct `name_or_path`) and the distillation step."""
    distill = config.distill
    teachers = {t.name_or_path: build_teacher(config, t, parts.cleanup) for t in distill.teachers}
    step = partial(
        train_on_batch,
        trainer=parts.trainer,
        teachers=teachers,
        tokenizer=parts.tokenizer,
        loss_fn=make_loss_fn(config),
        config=config,
    )
    return Learner("distill", step)


def build_teacher(config: DistillRunConfig, teacher: TeacherConfig, cleanup: ExitStack):
    """The teacher in this process, or in a Ray actor (`placement=ray`; Ray started here if the run has not)."""
    model = teacher_model(config, teacher)
    if teacher.placement == "driver":
        return Teacher(model, config.training, config.generation.temperature)
    from reinforge.cluster import worker_group
    from reinforge.cluster.teacher_group import TeacherGroup

    num_cpus = len(config.distill.teachers) * config.cluster.num_cpus_per_worker
    cleanup.callback(worker_group.ensure_ray(config.cluster, num_cpus))
    group = TeacherGroup(model, config.training, config.generation.temperature, config.cluster)
    cleanup.callback(group.shutdown)
    return group


def train_on_batch(
    step: int,
    rollout_batch: RolloutBatch,
    timers: Timers,
    *,
    trainer: TrainingBackend,
    teachers: dict[str, Teacher],
    tokenizer,
    loss_fn,
    config: DistillRunConfig,
) -> StepResult:
    """Teacher scores, the student's logprobs, per-token advantages (or the top-k targets) and the optimizer
    steps on one step's rollout batch."""
    distill, global_batch = config.distill, config.training.global_batch_size
    rewards_PG, metrics = step_rewards(step, rollout_batch, config.rollout.num_generations_per_prompt)
    if rewards_PG is None:  # nothing to learn from
        return StepResult(metrics, trained=False)
    trajectories = rollout_batch.trajectories
    baseline = BASELINES[distill.reward_baseline]
    reward_advantages_PG = distill.reward_weight * group_advantages(
        rewards_PG, baseline, distill.reward_normalize_std, valid_PG=valid_samples(trajectories, rewards_PG)
    )
    batch = collate(trajectories, reward_advantages_PG.flatten().tolist(), tokenizer.pad_token_id)

    with timers.time("teacher"):
        teacher_BT, topk_ids_BTK, teacher_topk_BTK = score_with_teachers(batch, trajectories, teachers, distill)
    with timers.time("logprobs"):
        batch.old_logprobs = trainer.logprobs(batch)
        if config.loss.kl_coef > 0:
            batch.ref_logprobs = trainer.logprobs(batch, reference=True)
    if distill.loss == "reverse_kl":
        batch.advantages = batch.advantages + distill.kl_coef * reverse_kl_advantages(
            teacher_BT, batch.old_logprobs, batch.loss_mask
        )
    else:
        batch = DistillBatch(
            **{f.name: getattr(batch, f.name) for f in fields(batch)},
            teacher_topk_ids=topk_ids_BTK,
            teacher_topk_logprobs=teacher_topk_BTK,
        )
    with timers.time("train"):
        global_batches = [batch.slice(s, s + global_batch) for s in range(0, len(batch), global_batch)]
        updates = [trainer.train_step(b, loss_fn, step) for b in global_batches if b.num_valid_tokens()]
    return StepResult(
        {
            **metrics,
            **rollout_metrics(trajectories, rewards_PG),
            **teacher_metrics(batch, teacher_BT),
            **token_advantage_metrics(batch, torch.zeros_like(rewards_PG), kl_in_reward=False),
            **train_metrics(updates),
        },
        trained=bool(updates),
        num_tokens=int(batch.attention_mask.sum()),
    )


def score_with_teachers(
    batch: TrainBatch, trajectories: list[Trajectory], teachers: dict[str, Teacher], d: DistillConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each answer scored by its task's teacher: (teacher logprobs [B, T], top-k ids [B, T, K], their logprobs
    [B, T, K]); K = 0 unless the loss is the top-k KL."""
    k = d.topk if d.loss == "topk_kl" else 0
    B, T = batch.loss_mask.shape
    logprobs_BT, ids_BTK, topk_BTK = torch.zeros(B, T), torch.zeros(B, T, k, dtype=torch.long), torch.zeros(B, T, k)
    for name, teacher in teachers.items():
        rows = [i for i, t in enumerate(trajectories) if d.teacher_of(t.task).name_or_path == name]
        if rows:
            part_BT, part_ids_BTK, part_topk_BTK = teacher.score(batch.select(rows), k)
            width = part_BT.shape[1]
            logprobs_BT[rows, :width], ids_BTK[rows, :width], topk_BTK[rows, :width] = (
                part_BT,
                part_ids_BTK,
                part_topk_BTK,
            )
    return logprobs_BT, ids_BTK, topk_BTK


def make_loss_fn(config: DistillRunConfig):
    """`reverse_kl`: GRPO's loss on the per-token advantages. `topk_kl`: GRPO's loss (the reward's advantages,
    0 without `reward_weight`) + kl_coef x the token mean of the top-k KL."""
    distill = config.distill
    pg_loss_fn = policy_loss_fn(config.loss, config.generation.max_new_tokens, config.off_policy)
    if distill.loss == "reverse_kl":
        return pg_loss_fn

    def loss_fn(logprobs_BT: torch.Tensor, micro: DistillBatch, norm):
        pg_loss, metrics = pg_loss_fn(logprobs_BT, micro, norm)
        kl_BT = topk_kl(
            micro.topk_logprobs,
            micro.teacher_topk_logprobs,
            distill.topk_kl,
            distill.mixed_kl_weight,
            renormalize=distill.topk_renormalize,
        )
        loss = pg_loss + distill.kl_coef * token_mean(kl_BT, micro.loss_mask, norm)
        return loss, {
            **metrics,
            "loss": loss.detach(),
            "distill_topk_kl": metric_mean(kl_BT.detach(), micro.loss_mask, norm),
        }

    # the training pass fills in the student's logprobs at the teacher's top-k ids, from the same LM-head chunks
    return with_outputs(loss_fn, LogprobsAt(ids="teacher_topk_ids", into="topk_logprobs"))


@dataclass
class DistillBatch(TrainBatch):
    """A rollout batch with the teacher's top-k targets of the top-k KL, and the student's logprobs at them."""

    teacher_topk_ids: torch.Tensor | None = None  # [B, T, K] long: the teacher's top-k token ids at each position
    teacher_topk_logprobs: torch.Tensor | None = None  # [B, T, K] float: their logprobs under the teacher
    topk_logprobs: torch.Tensor | None = None  # [B, T, K] float: the student's, filled in by the training pass


def teacher_metrics(batch: TrainBatch, teacher_BT: torch.Tensor) -> dict[str, float]:
    """How far the student is from the teacher on its own samples, per trained token."""
    mask_BT, num_tokens = batch.loss_mask, batch.loss_mask.sum().clamp(min=1)
    return {
        "train/distill_reverse_kl": (((batch.old_logprobs - teacher_BT) * mask_BT).sum() / num_tokens).item(),
        "train/teacher_logprob_mean": ((teacher_BT * mask_BT).sum() / num_tokens).item(),
    }
