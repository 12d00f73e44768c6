"""What the GRPO loop saves in a checkpoint and how it picks a run back up (`checkpoint.resume=auto`).

A resumed run continues as if it had never stopped: the trainer's weights, AdamW state and LR
schedule, the prompt sampler's position, the RNG states and the validation history come back from
the newest complete checkpoint, and so do the rollout batches that async generation had made ahead
of training; the engine is refitted with the restored weights (algorithms/refit.py); metrics.jsonl is
cut back to the checkpoint's step (the rows after it are recomputed, identically). The storage
format and its atomicity are `training/checkpoint.py`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from reinforge.algorithms.refit import refit
from reinforge.config import Config
from reinforge.data.prompts import PromptSampler
from reinforge.run_dir import make_run_dir
from reinforge.training.checkpoint import (
    check_compatible,
    latest_checkpoint,
    load_driver_state,
    prune,
    save_checkpoint,
    set_rng_state,
)


def open_run_dir(config: Config, warn=print) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from). With `resume=auto` an existing `logging.run_dir` is
    reused: resumed from its newest complete checkpoint, or started over when it has none."""
    requested = Path(config.logging.run_dir)
    if config.checkpoint.resume != "auto" or not requested.is_dir():
        return make_run_dir(requested), None
    checkpoint = latest_checkpoint(requested, warn=warn)
    if checkpoint is None:
        (requested / "metrics.jsonl").unlink(missing_ok=True)
        return requested, None
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    check_compatible(saved, config_tree(config, requested), checkpoint)
    return requested, checkpoint


def config_tree(config: Config, run_dir: Path) -> dict[str, Any]:
    return config.model_dump(mode="json") | {
        "logging": config.logging.model_dump(mode="json") | {"run_dir": str(run_dir)}
    }


def save_run_checkpoint(
    run_dir: Path,
    step: int,
    trainer,
    resume_state: dict[str, Any],
    val_history: list[float],
    best: dict[str, Any],
    config: Config,
    models: dict[str, Any] | None = None,
) -> None:
    """`resume_state`: the sampler position, the rollout batches generated but not yet trained on (async
    generation) and the RNG states, all taken while the engine was idle (`rollout_source.snapshot`);
    `models`: the backends a recipe trains beside the policy (`Learner.models`)."""
    driver_state = {
        "step": step,
        "sampler": resume_state["sampler"],
        "pending_rollouts": resume_state["pending"],
        "rng": resume_state["rng"],
        "val_history": val_history,
        "best": best,
    }
    save_checkpoint(
        run_dir, step, trainer, driver_state, yaml.safe_dump(config_tree(config, run_dir), sort_keys=False), models
    )
    prune(run_dir, config.checkpoint.keep_last, best.get("step"))


def update_best(best: dict[str, Any], step: int, metrics: dict[str, float], config: Config) -> dict[str, Any]:
    """The step whose checkpoint holds the best `checkpoint.keep_best_metric` so far (only saved steps count)."""
    name = config.checkpoint.keep_best_metric
    if not name or name not in metrics:
        return best
    value, sign = metrics[name], 1 if config.checkpoint.keep_best_mode == "max" else -1
    if "value" not in best or sign * value > sign * best["value"]:
        return {"step": step, "value": value}
    return best


def resume_run(
    checkpoint: Path,
    run_dir: Path,
    trainer,
    engine,
    sampler: PromptSampler,
    config: Config,
    models: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore the trainer (and `models`, by name) and the sampler, refit the engine, cut metrics.jsonl back;
    return the driver state (its RNG states are applied by `restore_rng` right before the loop, after the
    start-up probes)."""
    state = load_driver_state(checkpoint)
    trainer.load_state(checkpoint / "trainer")
    for name, model in (models or {}).items():
        model.load_state(checkpoint / name)
    refit(engine, trainer, config, run_dir)
    sampler.load_state_dict(state["sampler"])
    truncate_metrics(run_dir / "metrics.jsonl", state["step"])
    return state


def restore_rng(state: dict[str, Any]) -> None:
    set_rng_state(state["rng"])


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the rows of steps <= last_step (replaced atomically)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(row + "\n" for row in rows))
    os.replace(tmp, path)
