"""The supervised loop, written once: SFT, DPO and RM are its recipes.

Each step: draw the next global batch of examples (the recipe's `examples_per_step`) from a seeded sampler (a
fresh shuffle per epoch; `data.shuffle`); the recipe makes them a training batch and names its loss
(algorithms/supervised_recipe.py); one optimizer step on the training backend (the gradient accumulated micro-batch
by micro-batch, clipped, AdamW, the schedule advanced), in this process or on FSDP2 ranks (loops/builders.py,
`build_recipe_backend`); validate every `<recipe>.val_every` steps (and before the first and after the last); log
to metrics.jsonl and the configured loggers; checkpoint every `checkpoint.save_every` steps (and after the last).

As in the RL loop (loops/checkpointing.py, training/checkpoint.py): a checkpoint holds the weights, AdamW and the
schedule, the sampler's position, the RNG states and the validations so far, and `checkpoint.resume=auto`
continues from the newest: a run killed at any step and resumed ends with the metrics and weights of a run never
killed. A watchdog, beaten at each phase, stops a run that makes no progress for `deadlines.step_s` (hang.py); with
`cluster.max_restarts` a run whose process or rank died restarts itself from its last checkpoint (supervisor.py).

A recipe is a file with a root config (a `SupervisedRunConfig` plus its own sections) and a `SupervisedRecipe`
made from the config and the tokenizer; `train(config, make_recipe)` does the rest. The loop never branches on which
recipe it runs.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from reinforge.algorithms.supervised_recipe import SupervisedRecipe, SupervisedRunConfig
from reinforge.data.batch import TrainBatch
from reinforge.data.prompts import PromptSampler
from reinforge.hang import REPORT_NAME, BoundedExitStack, Watchdog
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import MetricLogger, check_backends
from reinforge.logging.memory import memory_metrics
from reinforge.logging.metrics import Timers
from reinforge.loops.builders import build_recipe_backend
from reinforge.loops.checkpointing import (
    METRICS_FILE,
    ResumeState,
    load_resume_state,
    save_run_checkpoint,
    start_run_dir,
    truncate_metrics,
    update_best,
)
from reinforge.loops.run_checks import trainer_device
from reinforge.modeling import load_tokenizer, save_tokenizer
from reinforge.run_dir import atomic_directory
from reinforge.training.base import LossFn
from reinforge.training.checkpoint import rng_state, set_rng_state
from reinforge.training.lora import check_lora
from reinforge.training.parallel.layout import check_model_layout

MakeRecipe = Callable[[Any, Any], SupervisedRecipe]  # (the recipe's root config, the tokenizer) -> the recipe


@dataclass
class SupervisedResult:
    run_dir: Path
    first_val: dict[str, float]  # val/ metrics before training (empty without validation)
    last_val: dict[str, float]  # val/ metrics after the last step


def train(config: SupervisedRunConfig, make_recipe: MakeRecipe) -> SupervisedResult:
    with BoundedExitStack(
        config.deadlines.cleanup_s
    ) as cleanup:  # the ranks, Ray, the watchdog, the loggers: on every way out
        return run(config, make_recipe, cleanup)


def run(config: SupervisedRunConfig, make_recipe: MakeRecipe, cleanup: ExitStack) -> SupervisedResult:
    steps = config.steps
    torch.manual_seed(config.seed)  # also seeds fresh weights (sft.random_init, the reward model's head)
    if config.cluster.num_threads:
        torch.set_num_threads(config.cluster.num_threads)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    check_model_layout(config.training.parallel, config.model)  # tp/cp/ep the model cannot split: one line
    check_backends(config.logging.loggers)
    print(f"devices: training on {trainer_device(config.training, config.cluster)}", flush=True)
    tokenizer = load_tokenizer(config.model)
    recipe = make_recipe(config, tokenizer)  # its data read and checked: a bad file is one line, no run directory

    run_dir, resume_from = start_run_dir(config, cleanup)
    backend = build_backend(config, recipe, cleanup)
    recipe.start(backend)  # before a checkpoint's weights replace the starting model's
    indices = list(range(len(recipe.examples)))  # the sampler draws examples by index
    sampler = PromptSampler(indices, recipe.examples_per_step, config.seed, config.data.shuffle)
    state = restore(resume_from, run_dir, backend, sampler, config) if resume_from else None
    metrics_log = cleanup.enter_context(MetricLogger(run_dir, config.logging.loggers))
    metrics_log.log_config(config.model_dump(mode="json"))
    if state:
        set_rng_state(state.rng)

    with ConsoleLog(steps.max_steps, recipe.title, completed=state.step if state else 0) as console:
        resumed = f" (resumed from {resume_from.name})" if resume_from else ""
        console.print(f"run directory: {run_dir}{resumed}")
        num_parameters, num_trained = backend.num_parameters()
        console.print(
            f"{len(recipe.examples)} training / {recipe.num_val} validation examples; "
            f"{num_parameters:,} parameters, {num_trained:,} trained"
        )
        # from here on, not during start-up (model loading, DPO's reference pass)
        watchdog = cleanup.enter_context(Watchdog(config.deadlines.step_s, run_dir / REPORT_NAME))
        loop = Loop(config, recipe, backend, sampler, run_dir, metrics_log, console, watchdog)
        val_history = loop.run(state)
        if config.checkpoint.save_final:
            watchdog.beat("the final model to be saved")
            with atomic_directory(run_dir / "final") as tmp:
                backend.save_pretrained(tmp)  # with LoRA, the adapter (and a reward model's head) in PEFT's format
                save_tokenizer(config.model, tmp)

    first, last = (val_history[0], val_history[-1]) if val_history else ({}, {})
    for name in recipe.summary if first else ():
        before, after = first[f"val/{name}"], last[f"val/{name}"]
        change = f"{after:.4f} ({after - before:+.4f})"
        console.print(f"val/{name} at step 0: {before:.4f}; at step {steps.max_steps}: {change}")
    final = f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else ""
    console.print(f"metrics: {run_dir / METRICS_FILE}{final}")
    return SupervisedResult(run_dir=run_dir, first_val=first, last_val=last)


def build_backend(config: SupervisedRunConfig, recipe: SupervisedRecipe, cleanup: ExitStack):
    """The recipe's model on the training backend, in this process or on FSDP2 ranks that `cleanup` stops."""
    model = recipe.model
    return build_recipe_backend(
        config,
        config.steps.max_steps,
        model.head,
        cleanup,
        rows_together=model.rows_together,
        row_tokens=model.row_tokens,
        load_reference=model.load_reference,
    )


@dataclass
class Loop:
    """The steps of a run, once it is set up: train, validate, log, checkpoint."""

    config: SupervisedRunConfig
    recipe: SupervisedRecipe
    backend: Any
    sampler: PromptSampler
    run_dir: Path
    metrics_log: MetricLogger
    console: ConsoleLog
    watchdog: Watchdog

    def run(self, state: ResumeState | None) -> list[dict[str, float]]:
        """From the start, or from a restored checkpoint's `state`, to `max_steps`; returns the validations' metrics."""
        steps, recipe, val = self.config.steps, self.recipe, None
        val_history, best = (state.val_history, state.best) if state else ([], {})
        if recipe.num_val:
            val = recipe.val_batch()
        if val and not state:
            self.watchdog.beat("the first validation")
            metrics = validate(self.backend, val)
            val_history.append(val_metrics(metrics))
            self.metrics_log.log(0, metrics)
            self.console.print(val_line(0, metrics, recipe.summary))
        for step in range((state.step if state else 0) + 1, steps.max_steps + 1):
            self.watchdog.beat(f"step {step}'s training")
            metrics = train_step(recipe, self.backend, self.sampler.next_batch(), step)
            if val and (step == steps.max_steps or (steps.val_every and step % steps.val_every == 0)):
                self.watchdog.beat(f"step {step}'s validation")
                metrics.update(validate(self.backend, val))
                val_history.append(val_metrics(metrics))
            metrics.update(memory_metrics("perf/"))  # the driver's
            metrics.update(self.backend.memory_metrics())  # each rank's, when the ranks are processes of their own
            self.metrics_log.log(step, metrics)
            self.console.step(step, metrics, show_line=step % self.config.logging.console_every == 0)
            if "val/loss" in metrics:
                self.console.print(val_line(step, metrics, recipe.summary))
            every = self.config.checkpoint.save_every
            if every and (step % every == 0 or step == steps.max_steps):
                self.watchdog.beat(f"step {step}'s checkpoint")
                best = update_best(best, step, metrics, self.config.checkpoint)
                resume_state = ResumeState(step, self.sampler.state_dict(), [], rng_state(), val_history, best)
                save_run_checkpoint(self.run_dir, resume_state, self.backend, self.config)
        return val_history


def restore(checkpoint: Path, run_dir: Path, backend, sampler: PromptSampler, config) -> ResumeState:
    """Restore the weights, AdamW and the schedule, and the sampler's position; cut metrics.jsonl back to the
    checkpoint's step (the rows after it are recomputed, identically). Returns the loop's state (its RNG states are
    applied right before the loop)."""
    state = load_resume_state(checkpoint, config)  # the sampler's order restarted on changed data, if allowed
    backend.load_state(checkpoint / "trainer")
    sampler.load_state_dict(state.sampler)
    truncate_metrics(run_dir / METRICS_FILE, state.step)
    return state


def train_step(recipe: SupervisedRecipe, backend, indices: list[int], step: int) -> dict[str, float]:
    """One optimizer step on the examples `indices` (a global batch); its metrics: the loss function's and the
    backend's (`train/`), how the batch was packed, its timings and throughput."""
    timers = Timers()
    with timers.time("step"):
        batch, loss_fn = recipe.train_batch(indices, timers)
        with timers.time("train"):
            updates = backend.train_step(batch, loss_fn, step)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    plan = backend.plan(lengths, None)
    num_slots = sum(len(rows) * max(sum(lengths[i] for i in row) for row in rows) for rows in plan)
    return {
        **{f"train/{name}": value for name, value in updates.items()},  # loss, grad_norm, lr, an MoE's routing, ...
        "train/epoch": step * recipe.examples_per_step / len(recipe.examples),
        "train/num_trained_tokens": batch.num_valid_tokens(),
        "train/num_micro_batches": len(plan),
        "perf/packing_efficiency": sum(lengths) / num_slots,
        "perf/tokens_per_s": sum(lengths) / timers.seconds["step"],
        **timers.metrics(),
    }


def validate(backend, val: tuple[TrainBatch, LossFn]) -> dict[str, float]:
    """The loss function's metrics over every held-out example, as one batch, in eval mode (`val/`)."""
    timers = Timers()
    with timers.time("val"):
        metrics = backend.evaluate(*val)
    return {**{f"val/{name}": value for name, value in metrics.items()}, **timers.metrics()}


def val_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in metrics.items() if name.startswith("val/")}


def val_line(step: int, metrics: dict[str, float], summary: tuple[str, ...]) -> str:
    names = dict.fromkeys(("loss", *summary))
    return f"step {step:>4} | " + " | ".join(f"val/{name} {metrics[f'val/{name}']:.4f}" for name in names)
