"""Run checkpoints: everything a run needs to continue exactly, written atomically.

Layout: `RUN_DIR/checkpoints/step_00000012/` holds
- `trainer/`: the policy weights and the optimizer and LR-scheduler state, written by the training
  backend as a torch.distributed.checkpoint by parameter name, each rank writing its own shards
  (training/state.py), which any layout reads: a run may resume with another `training.backend`,
  `training.num_workers` or `training.parallel` (one process, N FSDP2 ranks, a tensor-parallel mesh);
- `driver.pt`: the loop's own state: step, data sampler position, RNG states, validation history,
  curriculum state;
- `config.yaml`: the run's config, to refuse a resume under a different one;
- `COMPLETE`: written last, listing every file with its size and SHA-256. A directory without it, or
  whose files do not match it in size (a crash mid-save, a truncated copy) or, when a run resumes, in
  content (a corrupted disk or copy), is skipped with a warning naming it, and the resume falls back to
  the newest checkpoint that verifies. Its `finite` mark is false when a model's state was saved while
  non-finite optimizer steps were being skipped in a row (training/numerics.py: the weights are finite, the run
  was heading for a stop): a suspect checkpoint, which a resume passes over for the newest finite one and pruning
  never leaves alone (a checkpoint from before the mark counts as finite).

The directory is built under a temporary name, flushed to disk (fsync) and renamed into place
(run_dir.atomic_directory), so a kill or a power loss at any moment leaves either the previous newest
checkpoint or the new one, never a half-written newest; older checkpoints are pruned only after that.
`checkpoint.keep_last` keeps the newest N; `checkpoint.keep_best_metric` also keeps the best one by
that metric.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from reinforge.config.section import Section
from reinforge.config.tree import flatten
from reinforge.errors import ConfigError
from reinforge.hang import run_with_deadline
from reinforge.run_dir import atomic_directory
from reinforge.training.numerics import NUMERICS_FILE
from reinforge.training.safe_load import load_pickled


class CheckpointConfig(Section):
    save_final: bool = True
    """Write the trained policy in Hugging Face format to RUN_DIR/final at the end."""
    save_every: int = 0
    """Write a checkpoint (weights, optimizer, data position, RNG, step) every this many steps to
    RUN_DIR/checkpoints/step_N; 0: never."""
    keep_last: int = 2
    """Keep the newest this many checkpoints (0: keep all)."""
    keep_best_metric: str | None = None
    """Also keep the checkpoint with the best value of this metric (e.g. val/accuracy)."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether a higher or a lower `keep_best_metric` is better."""
    resume: Literal["auto", "never"] = "never"
    """`auto`: continue from the newest complete checkpoint in logging.run_dir (which is then reused,
    not suffixed); `never`: always start a new run."""
    on_data_change: Literal["error", "restart_order"] = "error"
    """What a resume does when the training data (`data.train_path`, pinned in every checkpoint by size, time and
    digest) changed since its checkpoint: `error`, stop with one line; `restart_order`, train on the new data from
    the start of its order (a fresh shuffle), the prompt ordinals going on from the checkpoint's
    (docs/reliability.md, "Ledgers")."""


STEP_DIR = re.compile(r"^step_(\d{8})$")
# settings that may change between a run and its resumption: the length of the run, where it logs,
# how it checkpoints, where its workers run and how the model is laid out over them (checkpoints reshard)
RESUMABLE_CHANGES = (
    *("loop.max_steps", "loop.val_every", "logging.", "checkpoint.", "cluster.", "data.max_val_prompts"),
    *("sft.val_every", "dpo.val_every", "rm.val_every", "data.max_val_pairs"),  # the supervised recipes' validation
    *("training.backend", "training.num_workers", "training.parallel.", "training.cpu_offload"),
    *("deadlines.", "training.collective_timeout_s", "agent.endpoint.request_timeout_s"),  # how long waits may take
    *("agent.first_call_timeout_s", "generation.verify_refit_every"),  # a check's deadline and frequency
    "generation.verify_refit_columns",  # and its sample
    "training.max_nonfinite_steps",  # raised to get a run past the bad steps that stopped it
)


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path,
    step: int,
    trainer,
    driver_state: dict[str, Any],
    config_yaml: str,
    models: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> Path:
    """Write checkpoint `step` atomically; returns its directory. `models`: backends trained beside the
    policy (PPO's critic), each saved by its `save_state` into a directory of its name. A write that takes more than
    `timeout_s` (`deadlines.checkpoint_s` in a run) raises a `HangError`; what it left is a temporary directory that
    no resume reads."""
    if timeout_s is not None:
        write = partial(save_checkpoint, run_dir, step, trainer, driver_state, config_yaml, models)
        return run_with_deadline(
            write, timeout_s, "checkpoint", f"checkpoint {step} to be written", "deadlines.checkpoint_s"
        )
    final = checkpoints_dir(run_dir) / f"step_{step:08d}"
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(final) as tmp:
        trainer.save_state(tmp / "trainer")
        for name, model in (models or {}).items():
            model.save_state(tmp / name)
        torch.save(driver_state, tmp / "driver.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        write_complete(tmp, step)
    return final


def write_complete(directory: Path, step: int) -> None:
    """The checkpoint's last file, COMPLETE: every file under `directory` with its size and SHA-256, and the
    `finite` mark of the models' states (their numerics.json)."""
    manifest = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
    finite = all(json.loads(p.read_text()).get("finite", True) for p in directory.glob(f"*/{NUMERICS_FILE}"))
    (directory / "COMPLETE").write_text(json.dumps({"step": step, "files": manifest, "finite": finite}, indent=1))


def is_finite(path: Path) -> bool:
    """The checkpoint's `finite` mark (true for one written before the mark, or whose marker is unreadable)."""
    try:
        return json.loads((path / "COMPLETE").read_text()).get("finite", True) is not False
    except (OSError, ValueError, AttributeError):
        return True


def sha256(path: Path) -> str:
    """The file's SHA-256, read right after it was written (from the page cache, not the disk)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    """COMPLETE's files as {name: {"size": ..., "sha256": ...}} (a checkpoint from before checksums: sizes only)."""
    files = json.loads((path / "COMPLETE").read_text())["files"]
    return {name: entry if isinstance(entry, dict) else {"size": entry} for name, entry in files.items()}


def is_complete(path: Path) -> bool:
    """The marker exists and every file it lists is there with its size (cheap: no file is read)."""
    return _matches_manifest(path, content=False)


def verifies(path: Path) -> bool:
    """Complete, and every file's content has the SHA-256 that COMPLETE recorded when it was written."""
    return _matches_manifest(path, content=True)


def _matches_manifest(path: Path, content: bool) -> bool:
    try:
        manifest = _manifest(path)
        if not all((path / name).stat().st_size == entry["size"] for name, entry in manifest.items()):
            return False
        return not content or all(
            sha256(path / name) == entry["sha256"] for name, entry in manifest.items() if "sha256" in entry
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest_checkpoint(run_dir: Path, warn=print) -> Path | None:
    """The newest checkpoint that verifies (sizes and content) and is marked finite; the others newer than it are
    skipped with a warning naming each. With no finite one, the newest suspect one that verifies."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    suspect = None
    for path in sorted((p for p in root.iterdir() if STEP_DIR.match(p.name)), reverse=True):
        if verifies(path):
            if is_finite(path):
                return path
            suspect = suspect or path
            warn(f"checkpoint {path} was saved while non-finite training steps were skipped in a row; skipping it")
            continue
        reason = "does not match its COMPLETE manifest's checksums (corrupt)" if is_complete(path) else "is incomplete"
        warn(f"checkpoint {path} {reason}; skipping it")
    if suspect is not None:
        warn(f"no checkpoint marked finite; resuming from {suspect}")
    return suspect


def load_driver_state(path: Path) -> dict[str, Any]:
    return load_pickled(path / "driver.pt")  # without running code: training/safe_load.py


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse to resume under a config that changes what was trained, naming the first setting that differs."""
    for key in sorted(set(flatten(saved)) | set(flatten(current))):
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        before, after = flatten(saved).get(key), flatten(current).get(key)
        if before != after:
            raise ConfigError(
                f"cannot resume from {path}: {key} was {before!r} there and is {after!r} now; resume with the same "
                f"setting, or start a new run (another logging.run_dir, or checkpoint.resume=never)"
            )


def prune(run_dir: Path, keep_last: int, best_step: int | None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (and the best one, if any), never the newest finite
    one while a newer one is suspect (its `finite` mark false)."""
    complete = sorted(p for p in checkpoints_dir(run_dir).iterdir() if STEP_DIR.match(p.name) and is_complete(p))
    keep = set(complete[-keep_last:]) if keep_last > 0 else set(complete)
    if best_step is not None:
        keep.add(checkpoints_dir(run_dir) / f"step_{best_step:08d}")
    finite = [path for path in complete if is_finite(path)]
    if finite and finite[-1] != complete[-1]:  # the newer ones are suspect: a resume goes back to this one
        keep.add(finite[-1])
    for path in complete:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    import random

    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
