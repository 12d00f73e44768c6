"""What the RL loop saves in a checkpoint and how it picks a run back up (`checkpoint.resume=auto`); the supervised
loop (supervised.py) opens its run directory and saves its checkpoints the same way, with no engine and no rollouts.

A resumed run continues as if it had never stopped: the trainer's weights, AdamW state and LR
schedule, the prompt sampler's position, the RNG states and the validation history come back from
the newest complete checkpoint, and so do the rollout batches that async generation had made ahead
of training; the engine is refitted with the restored weights (loops/refit.py); metrics.jsonl and
prompts.jsonl are cut back to the checkpoint's step (the rows after it are recomputed, identically). The storage
format and its atomicity are `training/checkpoint.py`'s.

prompts.jsonl accounts for the data: one row per step with the ordinals (places in the run's stream of drawn prompts,
`PromptSampler.drawn`) of the prompts the step trained on. Cut back like metrics.jsonl at every resume, it lists what
the final model was trained on: a run killed and resumed any number of times lists the same ordinals as a run never
killed, none missing and none twice (tests/e2e/test_async_resume.py).

Both ledgers survive a crash (docs/reliability.md, "Ledgers"): they are flushed to disk before each checkpoint is
written, a torn or NUL-filled tail is cut at resume with one line, and a restart never deletes a row: those it takes
out (the steps it redoes, or all of them when it starts over with no checkpoint) move to `<ledger>.attempt-N`. Every
checkpoint pins the training data (data/pin.py); a resume on changed data stops with one line, or with
`checkpoint.on_data_change=restart_order` restarts the data order.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.config.loader import save_config
from reinforge.data import pin
from reinforge.data.prompts import PromptSampler
from reinforge.errors import DataError
from reinforge.hang import hang_reports
from reinforge.logging.capture import capture_dependency_logs
from reinforge.logging.metrics import cut_ledger
from reinforge.loops.refit import refit
from reinforge.run_dir import announce_run_dir, fsync_path, make_run_dir
from reinforge.training.checkpoint import (
    CheckpointConfig,
    check_compatible,
    latest_checkpoint,
    load_driver_state,
    prune,
    save_checkpoint,
)

METRICS_FILE, PROMPTS_FILE = "metrics.jsonl", "prompts.jsonl"
LEDGERS = (METRICS_FILE, PROMPTS_FILE)
ATTEMPT = re.compile(rf"^(?:{'|'.join(map(re.escape, LEDGERS))})\.attempt-(\d+)$")  # a ledger's rows taken out


def open_run_dir(config: RLRunConfig, warn=print) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from). With `resume=auto` an existing `logging.run_dir` is
    reused: resumed from its newest complete checkpoint, or started over when it has none."""
    requested = Path(config.logging.run_dir)
    if config.checkpoint.resume != "auto" or not requested.is_dir():
        return make_run_dir(requested), None
    checkpoint = latest_checkpoint(requested, warn=warn)
    if checkpoint is None:  # start over; the ledgers' rows so far are an earlier attempt's, kept beside
        attempt = next_attempt(requested)
        for name in LEDGERS:
            if (requested / name).exists():
                (requested / name).rename(requested / f"{name}.attempt-{attempt}")
                warn(f"{requested / name}: no checkpoint to resume from; starting over, its rows so far kept as "
                     f"{name}.attempt-{attempt}")  # fmt: skip
        return requested, None
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    check_compatible(saved, config_tree(config, requested), checkpoint)
    data_changed(load_driver_state(checkpoint).get("data", {}), config, checkpoint, warn)
    return requested, checkpoint


def next_attempt(run_dir: Path) -> int:
    """The number of the next `<ledger>.attempt-N` in `run_dir`: one past the highest there."""
    numbers = [int(match.group(1)) for path in run_dir.iterdir() if (match := ATTEMPT.match(path.name))]
    return max(numbers, default=0) + 1


def data_changed(pinned: dict[str, Any], config, checkpoint: Path, notice=print) -> bool:
    """Whether the training data changed since `checkpoint` pinned it (`pinned`: its `ResumeState.data`): a one-line
    `DataError` under `checkpoint.on_data_change=error`, a one-line notice under `restart_order`."""
    change = pin.changed(pinned["train"], config.data.train_path) if "train" in pinned else None
    if change is None:
        return False
    if config.checkpoint.on_data_change == "error":
        raise DataError(
            f"cannot resume from {checkpoint}: the training data changed since it was saved (data.train_path: "
            f"{change}); put the checkpoint's data back, or resume with checkpoint.on_data_change=restart_order to "
            "train on the new data from the start of its order, or start a new run (checkpoint.resume=never)"
        )
    notice(
        f"data.train_path changed since {checkpoint} ({change}); checkpoint.on_data_change=restart_order: the new "
        "data is drawn from the start of its order, the prompt ordinals going on from the checkpoint's"
    )
    return True


def start_run_dir(config, cleanup: ExitStack) -> tuple[Path, Path | None]:
    """`open_run_dir`, then what every run does in it first: hang reports written there (`cleanup` exits them last),
    the directory announced to the supervisor (a restart resumes there), the dependencies' logs sent there, the
    resolved config saved as config.yaml."""
    run_dir, resume_from = open_run_dir(config)
    cleanup.enter_context(hang_reports(run_dir))  # exits last: a HangError's stacks were taken when it was raised
    announce_run_dir(run_dir)
    cleanup.enter_context(capture_dependency_logs(run_dir, config.logging.capture_dependency_logs))
    logging_here = config.logging.model_copy(update={"run_dir": str(run_dir)})
    save_config(config.model_copy(update={"logging": logging_here}), run_dir / "config.yaml")
    return run_dir, resume_from


def config_tree(config: RLRunConfig, run_dir: Path) -> dict[str, Any]:
    return config.model_dump(mode="json") | {
        "logging": config.logging.model_dump(mode="json") | {"run_dir": str(run_dir)}
    }


@dataclass
class ResumeState:
    """What the loop needs, beside the models' own state, to continue a run as if it had never stopped; saved as
    `driver.pt` in every checkpoint. `sampler`: the prompt sampler's position; `pending_rollouts`: the rollout
    batches generated ahead but not yet trained on (async generation); `rng`: the RNG states, taken while the
    engine was idle (`rollout_source.snapshot`); `val_history`: the validations so far (the RL loop's val/accuracy
    values, the supervised loop's val/ metrics); `best`: the best `checkpoint.keep_best_metric` so far; `data`: the
    training data it was trained on (filled in by `save_run_checkpoint`)."""

    step: int
    sampler: dict[str, Any]
    pending_rollouts: list[Any]
    rng: dict[str, Any]
    val_history: list[Any] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # the training data's pin (data/pin.py), under "train"


def save_run_checkpoint(
    run_dir: Path, state: ResumeState, trainer, config: RLRunConfig, models: dict[str, Any] | None = None
) -> None:
    """The trainer's and `models`' states (the backends a recipe trains beside the policy, `Learner.models`), the
    loop's `state`, the training data's pin and the resolved config, as checkpoint `state.step`, once the ledgers'
    rows up to it are on disk; older checkpoints pruned."""
    tree = yaml.safe_dump(config_tree(config, run_dir), sort_keys=False)
    # shallow: the pending rollout batches stay objects (asdict would turn them into dicts)
    driver_state = {field.name: getattr(state, field.name) for field in fields(state)}
    driver_state["data"] = {"train": pin.pin(config.data.train_path)}
    for name in LEDGERS:  # the rows this checkpoint covers survive a power loss once it exists
        if (run_dir / name).exists():
            fsync_path(run_dir / name)
    fsync_path(run_dir)  # and so do the ledgers' names (created, or replaced by a resume's cut)
    save_checkpoint(run_dir, state.step, trainer, driver_state, tree, models, config.deadlines.checkpoint_s)
    prune(run_dir, config.checkpoint.keep_last, state.best.get("step"))


def update_best(
    best: dict[str, Any], step: int, metrics: dict[str, float], checkpoint: CheckpointConfig
) -> dict[str, Any]:
    """The step whose checkpoint holds the best `checkpoint.keep_best_metric` so far (only saved steps count)."""
    name = checkpoint.keep_best_metric
    if not name or name not in metrics:
        return best
    value, sign = metrics[name], 1 if checkpoint.keep_best_mode == "max" else -1
    if "value" not in best or sign * value > sign * best["value"]:
        return {"step": step, "value": value}
    return best


def resume_run(
    checkpoint: Path,
    run_dir: Path,
    trainer,
    engine,
    sampler: PromptSampler,
    config: RLRunConfig,
    models: dict[str, Any] | None = None,
) -> ResumeState:
    """Restore the trainer (and `models`, by name) and the sampler, refit the engine, cut the ledgers back;
    return the loop's state (its RNG states are applied right before the loop, after the start-up probes)."""
    state = load_resume_state(checkpoint, config)
    trainer.load_state(checkpoint / "trainer")
    for name, model in (models or {}).items():
        model.load_state(checkpoint / name)
    refit(engine, trainer, config, run_dir)
    sampler.load_state_dict(state.sampler)
    attempt = next_attempt(run_dir)
    for name in LEDGERS:
        truncate_metrics(run_dir / name, state.step, attempt)
    return state


def load_resume_state(checkpoint: Path, config) -> ResumeState:
    """The loop's state in `checkpoint`; on training data changed since (allowed by `checkpoint.on_data_change`), its
    sampler state restarts the data order with the ordinals going on (`state_dict` of data/prompts.py's
    `PromptSampler`, data/prompt_stream.py's `PromptStream`, data/curriculum.py's `ProgressiveSampler`)."""
    state = ResumeState(**load_driver_state(checkpoint))
    if data_changed(state.data, config, checkpoint, notice=lambda line: None):  # open_run_dir said it
        sampler = state.sampler
        state.sampler = (
            {"step": sampler["step"], "epoch": 0}
            if "step" in sampler
            else {"epoch": 0, "position": 0, "drawn": sampler["drawn"]}
        )
    return state


def log_trained_prompts(
    run_dir: Path, step: int, trajectories, discarded: dict[int, str] | None = None
) -> dict[str, float]:
    """Append step `step`'s row to prompts.jsonl: the ordinals of the prompts its batch trains on, each once, of
    those whose every sample was left out (their group dropped for infrastructure failures, rollout/infra.py), and of
    those drawn for it but `discarded` (by reason: dynamic sampling's); return them as `data/*` metrics (how many,
    the first and the last)."""
    kept = {t.prompt_ordinal for t in trajectories if not t.excluded}
    ordinals, dropped = sorted(kept), sorted({t.prompt_ordinal for t in trajectories} - kept)
    versions = sorted({trajectory.policy_version for trajectory in trajectories})
    by_reason: dict[str, list[int]] = {}
    for ordinal, reason in sorted((discarded or {}).items()):
        by_reason.setdefault(reason, []).append(ordinal)
    row = {"step": step, "ordinals": ordinals, "dropped": dropped, "discarded": by_reason, "policy_versions": versions}
    with open(run_dir / PROMPTS_FILE, "a") as file:
        file.write(json.dumps(row) + "\n")
    metrics = {
        "data/prompts_trained": float(len(ordinals)),
        "data/prompts_dropped": float(len(dropped)),
        "data/prompts_discarded": float(len(discarded or {})),
    }
    if ordinals:
        metrics.update(
            {"data/first_prompt_ordinal": float(ordinals[0]), "data/last_prompt_ordinal": float(ordinals[-1])}
        )
    return metrics


def truncate_metrics(path: Path, last_step: int, attempt: int | None = None) -> None:
    """Keep the rows of steps <= last_step (replaced atomically); the later ones move to `<ledger>.attempt-N`
    (`attempt`, by default the next), a torn or NUL-filled tail is cut with one line on the console (stdout: stderr
    goes to RUN_DIR/logs by then)."""
    attempt = attempt or next_attempt(path.parent)
    cut_ledger(path, last_step, path.with_name(f"{path.name}.attempt-{attempt}"), notice=print)
