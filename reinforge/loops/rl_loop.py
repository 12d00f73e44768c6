"""The RL loop, written once: GRPO, PPO and on-policy distillation are its recipes.

Each step: take the step's scored rollouts (generated now, or ahead of training under async generation,
loops/rollouts.py); hand them to the recipe's `Learner` (its advantages, extra models and optimizer steps);
copy the new weights into the generation engine ("refit"); check, after the first refit, that the engine really
moved to the trainer's weights; validate every `loop.val_every` steps; log; checkpoint. Every wait has a deadline;
a watchdog, beaten at each phase, stops a run that makes no progress for `deadlines.step_s`, and another, beaten at
each phase of start-up (loading the models, starting the engines, the curriculum's pre-filter, the resume and its
refit, the start-up probe), one whose phase takes longer than `deadlines.startup_s`; a wait past its deadline
writes RUN_DIR/hang_report.txt (every thread's and worker's stack) and ends the run with one line (hang.py).
With `rollout.driver=agent` agents drive the episodes through the policy's OpenAI-compatible endpoint
(rollout/agent.py); the loop is the same.

A recipe is a root config (an `RLRunConfig` plus its own sections) and a learner factory `make_learner(config,
parts) -> Learner` (algorithms/learner.py), both named in loops/registry.py; `run(config, make_learner)` does the
rest, in phases: read the inputs, build the parts, start (or resume), the steps, finish. The loop never branches on
which recipe it runs.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from reinforge.algorithms import consistency
from reinforge.algorithms.learner import Learner, LearnerParts, MakeLearner, RunResult, StepResult
from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.config.loader import save_config
from reinforge.data.prompts import PromptSampler
from reinforge.envs.base import Environment
from reinforge.generation.base import GenerationBackend
from reinforge.hang import REPORT_NAME, BoundedExitStack, Watchdog, hang_reports
from reinforge.logging.capture import capture_dependency_logs
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import MetricLogger
from reinforge.logging.memory import memory_metrics
from reinforge.logging.metrics import Timers
from reinforge.loops.builders import (
    build_critic,
    build_engine,
    build_environments,
    build_episodes,
    build_trainer,
    start_ray_if_needed,
    write_placement,
)
from reinforge.loops.checkpointing import (
    ResumeState,
    log_trained_prompts,
    open_run_dir,
    resume_run,
    save_run_checkpoint,
    update_best,
)
from reinforge.loops.curriculum_prefilter import build_prompt_sampler
from reinforge.loops.refit import refit
from reinforge.loops.rollouts import open_rollouts, sampling_params
from reinforge.loops.run_checks import Inputs, read_inputs
from reinforge.loops.validation import validate
from reinforge.modeling import save_tokenizer
from reinforge.rollout.rollout import Episodes
from reinforge.run_dir import announce_run_dir, atomic_directory
from reinforge.training.base import TrainingBackend
from reinforge.training.checkpoint import rng_state, set_rng_state


@dataclass
class Parts(Inputs):
    """A run's inputs and the parts built from them, once; every phase reads them."""

    run_dir: Path
    resume_from: Path | None  # the checkpoint the run continues from
    envs: dict[str, Environment]
    trainer: TrainingBackend
    engine: GenerationBackend
    episodes: Episodes
    sampler: PromptSampler
    curriculum_metrics: dict[str, float]
    learner: Learner


@dataclass
class Progress:
    """What the steps carry from one to the next and a checkpoint saves: the last step done, the validation
    accuracies so far, the best checkpoint, the rollouts a resumed checkpoint had generated ahead."""

    step: int = 0
    val_history: list[float] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=dict)
    pending: list = field(default_factory=list)


def run(config: RLRunConfig, make_learner: MakeLearner, on_step_end: Callable[[int], None] | None = None) -> RunResult:
    """Run the RL loop with the recipe's learner. `on_step_end`, for tools that observe or pace the loop
    (bench/grpo_vs_trl.py), is called once the run is set up, with the step it starts from (0, or the resumed
    step), then after every step, once it is logged and checkpointed, with that step."""
    torch.manual_seed(config.seed)
    if config.cluster.num_threads:
        torch.set_num_threads(config.cluster.num_threads)
    inputs = read_inputs(config)
    with BoundedExitStack(config.deadlines.cleanup_s) as cleanup:  # workers, engines, verifiers: released on every exit
        run_dir, resume_from = open_run(config, cleanup)
        with Watchdog(config.deadlines.startup_s, run_dir / REPORT_NAME, "deadlines.startup_s") as startup:
            parts = build_parts(inputs, run_dir, resume_from, make_learner, cleanup, startup.beat)
            progress, metrics_log = start(parts, cleanup, startup.beat)
        with ConsoleLog(config.loop.max_steps, parts.learner.title, completed=progress.step) as console:
            resumed = f" (resumed from {parts.resume_from.name})" if parts.resume_from else ""
            console.print(f"run directory: {parts.run_dir}{resumed}")
            # from here on; start-up had its own (model loading, the curriculum's pre-filter may take long)
            watchdog = cleanup.enter_context(Watchdog(config.deadlines.step_s, parts.run_dir / REPORT_NAME))
            if parts.val_prompts and not parts.resume_from:
                watchdog.beat("the first validation")
                first_validation(parts, progress, metrics_log, console)
            rollouts = open_rollouts(config, parts.learner, parts.sampler, parts.episodes, parts.engine, parts.envs,
                                     progress.step, progress.pending)  # fmt: skip
            cleanup.callback(rollouts.close)
            if on_step_end:
                on_step_end(progress.step)
            for step in range(progress.step + 1, config.loop.max_steps + 1):
                train_step(step, parts, progress, rollouts, watchdog, metrics_log, console)
                if on_step_end:
                    on_step_end(step)
            if config.checkpoint.save_final:
                watchdog.beat("the final model to be saved")
                save_final(parts)
    return finish(parts, progress, console)


def open_run(config: RLRunConfig, cleanup: ExitStack) -> tuple[Path, Path | None]:
    """The run directory (its config, hang reports, dependency logs) and the checkpoint it resumes from, if any."""
    run_dir, resume_from = open_run_dir(config)
    cleanup.enter_context(hang_reports(run_dir))  # exits last: a HangError's stacks were taken when it was raised
    announce_run_dir(run_dir)  # to the supervisor, if any: a restart resumes here
    cleanup.enter_context(capture_dependency_logs(run_dir, config.logging.capture_dependency_logs))
    logging_here = config.logging.model_copy(update={"run_dir": str(run_dir)})
    save_config(config.model_copy(update={"logging": logging_here}), run_dir / "config.yaml")
    return run_dir, resume_from


def build_parts(
    inputs: Inputs, run_dir: Path, resume_from: Path | None, make_learner: MakeLearner, cleanup: ExitStack,
    beat: Callable[[str], None],
) -> Parts:  # fmt: skip
    """Ray when the run uses it, the environments, the trainer, the engine, the episodes, the prompt sampler and the
    recipe's learner; each released on `cleanup`. `beat(what)` as each phase starts (the start-up watchdog's)."""
    config, tokenizer = inputs.config, inputs.tokenizer
    beat("the start of Ray and the environments")
    start_ray_if_needed(config, cleanup)
    envs = build_environments(config, inputs.tasks, cleanup)
    beat("the trainer's model loading")
    trainer = build_trainer(config, cleanup)
    beat("the generation engine's start")
    engine = build_engine(config, tokenizer, trainer, cleanup)
    all_prompts = inputs.train_prompts + inputs.val_prompts
    episodes = build_episodes(config, engine, tokenizer, envs, all_prompts, run_dir, cleanup)
    beat("the prompt sampler (the curriculum's pre-filter)")

    def progress_line(line: str) -> None:  # the pre-filter's, after each chunk
        print(line, flush=True)
        beat("the curriculum pre-filter's next chunk")

    # may sample with the engine: the curriculum's pass rates
    sampler, curriculum_metrics = (
        (inputs.stream, {})
        if inputs.stream
        else build_prompt_sampler(config, inputs.train_prompts, engine, tokenizer, envs, run_dir, progress_line)
    )
    beat("the recipe's learner (its critic's loading)")
    write_placement(run_dir, trainer, engine, envs)
    critic = partial(build_critic, config, cleanup=cleanup)
    learner = make_learner(config, LearnerParts(trainer, tokenizer, cleanup, critic))
    return Parts(
        **vars(inputs),
        run_dir=run_dir,
        resume_from=resume_from,
        envs=envs,
        trainer=trainer,
        engine=engine,
        episodes=episodes,
        sampler=sampler,
        curriculum_metrics=curriculum_metrics,
        learner=learner,
    )


def start(parts: Parts, cleanup: ExitStack, beat: Callable[[str], None]) -> tuple[Progress, MetricLogger]:
    """Resume from the run's checkpoint, if any; probe that the engine and the trainer agree; open the metrics.
    `beat(what)` as each phase starts (the start-up watchdog's)."""
    config, progress, state = parts.config, Progress(), None
    if parts.resume_from:
        beat(f"the resume from {parts.resume_from.name} (the weights, the engine's refit)")
        state = resume_run(
            parts.resume_from, parts.run_dir, parts.trainer, parts.engine, parts.sampler, config, parts.learner.models
        )
        progress = Progress(state.step, state.val_history, state.best, state.pending_rollouts)
    beat("the start-up probe")
    check_consistency(parts, "at start-up")
    metrics_log = cleanup.enter_context(MetricLogger(parts.run_dir, config.logging.loggers))
    metrics_log.log_config(config.model_dump(mode="json"))
    if state:
        set_rng_state(state.rng)  # after the start-up probe, which samples
    return progress, metrics_log


def first_validation(parts: Parts, progress: Progress, metrics_log: MetricLogger, console: ConsoleLog) -> None:
    timers = Timers()
    with timers.time("val"):
        val_metrics = validation(parts)
    val_metrics.update(timers.metrics())
    progress.val_history.append(val_metrics["val/accuracy"])
    metrics_log.log(0, val_metrics)
    console.step(0, val_metrics, show_line=True)


def train_step(step: int, parts: Parts, progress: Progress, rollouts, watchdog: Watchdog, metrics_log, console) -> None:
    """One step: its rollouts and the learner's training on them, the engine's turn, the log and the checkpoint."""
    config = parts.config
    watchdog.beat(f"step {step}'s rollouts and training")
    timers = Timers()
    with timers.time("step"):
        batch = rollouts.get(step, timers)  # async: the wait for what generation ahead did not hide
        result = parts.learner.train_on_batch(step, batch, timers)
    every = config.checkpoint.save_every
    saving = bool(every) and (step % every == 0 or step == config.loop.max_steps)
    watchdog.beat(f"step {step}'s refit and validation")
    snapshot, rng = engine_turn(step, parts, progress, rollouts, result, timers, saving)
    watchdog.beat(f"step {step}'s logging and checkpoint")
    metrics = result.metrics
    metrics.update(timers.metrics())
    metrics["perf/tokens_per_s"] = result.num_tokens / timers.seconds["step"]
    metrics.update(memory_metrics("perf/"))  # the driver's
    metrics.update(parts.trainer.memory_metrics())  # each rank's, when the ranks are processes of their own
    metrics.update(parts.curriculum_metrics)
    metrics.update(log_trained_prompts(parts.run_dir, step, batch.trajectories, batch.discarded))
    metrics_log.log(step, metrics)
    console.step(step, metrics, show_line=step % config.logging.console_every == 0 or "val/accuracy" in metrics)
    if saving:
        progress.best = update_best(progress.best, step, metrics, config.checkpoint)
        state = ResumeState(step, snapshot["sampler"], snapshot["pending"], rng, progress.val_history, progress.best)
        save_run_checkpoint(parts.run_dir, state, parts.trainer, config, parts.learner.models)


def engine_turn(
    step: int, parts: Parts, progress: Progress, rollouts, result: StepResult, timers: Timers, saving: bool
) -> tuple[dict | None, Any]:
    """The engine is the loop's between steps: refit, then probe, validate, and (when `saving`) the rollout
    source's snapshot and the RNG states for the checkpoint."""
    config, metrics = parts.config, result.metrics
    with rollouts.engine_turn(step, timers):
        if result.trained:
            with timers.time("step"), timers.time("refit"):
                metrics.update(refit(parts.engine, parts.trainer, config, parts.run_dir, step, timers))  # verified
        if step == 1:  # the first refit must really have moved the engine to the trainer's weights
            check_consistency(parts, "after the first refit")
        val_every = config.loop.val_every
        if parts.val_prompts and (step == config.loop.max_steps or (val_every and step % val_every == 0)):
            with timers.time("val"):
                metrics.update(validation(parts))
            progress.val_history.append(metrics["val/accuracy"])
        return (rollouts.snapshot(), rng_state()) if saving else (None, None)


def save_final(parts: Parts) -> None:
    with atomic_directory(parts.run_dir / "final") as tmp:
        parts.trainer.save_pretrained(tmp)
        save_tokenizer(parts.config.model, tmp)


def finish(parts: Parts, progress: Progress, console: ConsoleLog) -> RunResult:
    """The run's summary: its first and last validation accuracy, where its metrics and final model are."""
    history, max_steps = progress.val_history, parts.config.loop.max_steps
    first, last = (history[0], history[-1]) if history else (None, None)
    if first is not None:
        console.print(f"val/accuracy at step 0: {first:.3f}")
        console.print(f"val/accuracy at step {max_steps}: {last:.3f} ({last - first:+.3f})")
    final = f"   final model: {parts.run_dir / 'final'}" if parts.config.checkpoint.save_final else ""
    console.print(f"metrics: {parts.run_dir / 'metrics.jsonl'}{final}")
    return RunResult(run_dir=parts.run_dir, first_val_accuracy=first, last_val_accuracy=last)


def check_consistency(parts: Parts, when: str) -> None:
    """Stop the run if the engine's logprobs disagree with the trainer's (see algorithms/consistency.py)."""
    params = sampling_params(parts.config, 0)
    probe_prompts = parts.train_prompts[: parts.config.generation.num_probe_prompts]
    min_tokens = consistency.probe_tokens(parts.config.model, parts.config.data.max_prompt_tokens)
    error = consistency.probe(probe_prompts, parts.engine, parts.trainer, parts.tokenizer, params, min_tokens)
    consistency.check(error, parts.config.generation.max_logprob_error, when, params)


def validation(parts: Parts) -> dict[str, float]:
    return validate(
        parts.config, parts.val_prompts, parts.episodes, parts.engine, parts.tokenizer, parts.envs, parts.benchmarks
    )
