"""The seam between the RL loop (loops/rl_loop.py) and its recipes (grpo.py, ppo.py, distill.py): what the loop
hands a recipe's learner factory (`LearnerParts`), what the factory hands back (a `Learner`: what the recipe does
with each step's rollouts) and what the loop and the recipe's step return. loops/registry.py names each recipe's
factory; a recipe never imports the loop."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.data.batch import Trajectory
from reinforge.logging.metrics import Timers
from reinforge.rollout.source import RolloutBatch
from reinforge.training.base import TrainingBackend
from reinforge.training.optimizer import OptimizerConfig

# One rollout round of a step: round index -> scored trajectories (a fresh sampling seed per round).
RolloutRound = Callable[[int], list[Trajectory]]


@dataclass
class StepResult:
    """What a learner's step returns: its metrics, whether the policy changed (the refit is then due), and the
    tokens it trained on (for the loop's tokens per second)."""

    metrics: dict[str, float]
    trained: bool
    num_tokens: int = 0


class Checkpointable(Protocol):
    """A model a recipe trains beside the policy (PPO's critic), saved in and restored from every checkpoint."""

    def save_state(self, path: Path) -> None: ...

    def load_state(self, path: Path) -> None: ...


@dataclass
class Learner:
    """What a recipe does with each step's rollouts. `train_on_batch(step, rollout_batch, timers)`: the step's
    advantages, extra models' passes and optimizer steps. `models`: the models it trains beside the policy, by
    name (checkpointed with it). `collect_groups`: how a step's rollout rounds make its batch (GRPO's dynamic
    sampling rolls out further rounds; by default one round)."""

    title: str
    train_on_batch: Callable[[int, RolloutBatch, Timers], StepResult]
    models: dict[str, Checkpointable] = field(default_factory=dict)
    collect_groups: Callable[[RolloutRound], tuple[list[Trajectory], dict[str, float]]] | None = None


@dataclass
class LearnerParts:
    """What the loop hands a recipe's learner factory: the policy's trainer, the tokenizer, the run's `cleanup`
    (a part the recipe starts itself, a teacher, is released on it), and `build_critic(optimizer)`: a value model
    (the base model with a value head) beside the policy, on the run's training backend and placement, with AdamW
    as `optimizer` says; the loop knows where models go, the recipe which models it needs."""

    trainer: TrainingBackend
    tokenizer: Any
    cleanup: ExitStack
    build_critic: Callable[[OptimizerConfig], TrainingBackend]


# A recipe's learner factory, named in loops/registry.py: called once the run's parts are built.
MakeLearner = Callable[[RLRunConfig, LearnerParts], Learner]


@dataclass
class RunResult:
    run_dir: Path
    first_val_accuracy: float | None
    last_val_accuracy: float | None
