"""`distill`: on-policy distillation's settings (algorithms/distill.py has the recipe), and `DistillRunConfig`, the
tree of a `reinforge distill` run: the RL loop's sections (algorithms/rl_config.py) plus `distill`. No `grpo` or
`overlong` section and no `loss.kl_in_reward`: distillation's signal is the teacher's, so GRPO's reward shaping
is an unknown key here."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from reinforge.algorithms.rl_config import MOVED_KEYS, RLRunConfig
from reinforge.config.section import Section
from reinforge.logging.loggers import LoggingConfig


class TeacherConfig(Section):
    name_or_path: str
    """The teacher model: a Hugging Face id or a local directory. Its tokenizer must be the student's (the
    same vocabulary and special tokens): the teacher scores the student's token ids as they are."""
    tasks: list[str] = []
    """The tasks (each record's `task`) whose answers this teacher scores; empty: every task no other teacher names."""
    placement: Literal["driver", "ray"] = "driver"
    """Where the teacher runs: `driver`, in this process; `ray`, in a Ray actor of its own with
    `cluster.num_cpus_per_worker` CPUs and `cluster.num_gpus_per_worker` GPUs (Ray is started if the run has
    not; a Ray the run starts for other workers must have room for it: `cluster.num_cpus`)."""


class DistillConfig(Section):
    teachers: list[TeacherConfig] = Field(default=[TeacherConfig(name_or_path="models/demo_teacher")], min_length=1)
    """One teacher, or several mixed per task (`tasks`); at most one may leave `tasks` empty (the default teacher)."""
    loss: Literal["reverse_kl", "topk_kl"] = "topk_kl"
    """`topk_kl`: a KL between teacher and student over the teacher's top `topk` tokens at each position
    (NeMo-RL's); `reverse_kl`: the sampled-token reverse KL as a per-token advantage, A_t = log pi_teacher(y_t) -
    log pi_student(y_t), through GRPO's clipped surrogate (Thinking Machines' on-policy distillation, Tinker).
    The default is the one that learns faster on the demo (docs/benchmarks.md)."""
    kl_coef: float = Field(default=1.0, gt=0)
    """Weight of the distillation term: of the reverse-KL advantage, or of the top-k KL in the loss."""
    topk: int = Field(default=64, gt=0)
    """`topk_kl`: how many of the teacher's most likely tokens per position (NeMo-RL: 64)."""
    topk_kl: Literal["forward", "reverse", "mixed"] = "forward"
    """`topk_kl`: KL(teacher || student) (`forward`), KL(student || teacher) (`reverse`), or `mixed`, both
    restricted to the teacher's top-k tokens (NeMo-RL's kl_type)."""
    topk_renormalize: bool = True
    """`topk_kl`: renormalise the teacher's and the student's probabilities over the teacher's top-k ids
    (log-softmax of each side's k logprobs) before the KL, so that it is a KL between two distributions on those
    k tokens (NeMo-RL's default, zero_outside_topk=false). false: the full-vocabulary probabilities at those ids,
    the mass outside them ignored (the reverse KL may then be negative). The two agree when `topk` is the
    vocabulary size."""
    mixed_kl_weight: float = Field(default=0.5, ge=0, le=1)
    """`topk_kl=mixed`: w * forward + (1 - w) * reverse (NeMo-RL's mixed_kl_weight, the forward KL's weight)."""
    reward_weight: float = Field(default=0.0, ge=0)
    """Adds the environment reward: `reward_weight` x the group-relative advantage of the reward (GRPO's, with
    `reward_baseline` and `reward_normalize_std`) on every token of the sequence, beside the distillation term.
    0: the teacher alone."""
    reward_baseline: Literal["mean", "leave_one_out"] = "mean"
    """With `reward_weight`: the group baseline of the reward's advantage, the group mean or the mean of the others."""
    reward_normalize_std: bool = True
    """With `reward_weight`: divide the reward's advantage by the group's reward standard deviation."""

    @model_validator(mode="after")
    def _check_teachers(self) -> "DistillConfig":
        defaults = [t.name_or_path for t in self.teachers if not t.tasks]
        if len(defaults) > 1:
            raise ValueError(
                f"distill.teachers: {len(defaults)} teachers ({', '.join(defaults)}) have no tasks; at most one "
                "may be the default teacher, so give the others `tasks`"
            )
        seen: dict[str, str] = {}
        for teacher in self.teachers:
            for task in teacher.tasks:
                if task in seen:
                    raise ValueError(
                        f"distill.teachers: task {task} is named by two teachers ({seen[task]} and "
                        f"{teacher.name_or_path}); give each task one teacher"
                    )
                seen[task] = teacher.name_or_path
        return self

    def teacher_of(self, task: str) -> TeacherConfig | None:
        """The teacher that scores `task`'s answers (the one naming it, else the default), or None."""
        named = [t for t in self.teachers if task in t.tasks]
        return named[0] if named else next((t for t in self.teachers if not t.tasks), None)


class DistillRunConfig(RLRunConfig):
    """A whole `reinforge distill` run."""

    recipe: ClassVar[str] = "distill"
    moved_keys: ClassVar[dict[str, str]] = {
        **MOVED_KEYS,
        "grpo.baseline": "distill.reward_baseline",
        "grpo.normalize_std": "distill.reward_normalize_std",
    }
    distill: DistillConfig = DistillConfig()
    """The teachers and the distillation loss."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/distill")
    """Run directory (config.yaml, metrics.jsonl, checkpoints/, final/) and console output."""
