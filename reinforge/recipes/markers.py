"""What a finished stage leaves behind, and the checks that keep a resumed recipe honest.

A stage is finished when RUN_DIR/stages/<kk>-<name>/stage_complete.json exists: written atomically
(temporary file, fsync, rename) after the stage's training returned, holding its final metrics (the
last row of its metrics.jsonl), the path of its final weights, and the config it trained with.

On a rerun, a finished stage is skipped only if the recipe still builds the same config for it, up
to settings that do not change what was trained (`IGNORED`); otherwise the run is refused, naming the
stage and the setting: its weights, and every later stage's, would no longer be what the recipe says.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from reinforge.config.tree import flatten
from reinforge.errors import ConfigError
from reinforge.recipes.stages import Stage, stage_dir_name
from reinforge.run_dir import atomic_write_text

MARKER = "stage_complete.json"
# Settings a finished stage may differ in: where and how it ran and was saved, and its validation,
# which reads the weights but never changes them (GRPO's resume allows the same changes).
IGNORED = (
    "logging.",
    "cluster.",
    "checkpoint.",
    "loop.val_every",
    "loop.val_benchmark",
    "data.max_val_prompts",
    "data.max_val_pairs",
    "sft.val_every",
    "dpo.val_every",
    "rm.val_every",
)


def stage_config(stage: Stage) -> dict[str, Any]:
    return stage.config.model_dump(mode="json")


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of the settings that define what the stage trains (IGNORED left out)."""
    kept = {k: v for k, v in flatten(config).items() if not k.startswith(IGNORED)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def read_marker(stage: Stage) -> dict[str, Any] | None:
    path = stage.run_dir / MARKER
    return json.loads(path.read_text()) if path.is_file() else None


def write_marker(stage: Stage, started_at: float) -> dict[str, Any]:
    config = stage_config(stage)
    marker = {
        "stage": stage.name,
        "number": stage.number,
        "algorithm": stage.algorithm,
        "run_dir": str(stage.run_dir),
        "weights": str(stage.weights) if stage.weights else None,
        "metrics": final_metrics(stage.run_dir),
        "duration_s": round(time.time() - started_at, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config_sha256": config_digest(config),
        "config": config,
    }
    atomic_write_text(stage.run_dir / MARKER, json.dumps(marker, indent=1) + "\n")
    return marker


def final_metrics(run_dir: Path) -> dict[str, Any]:
    """The last row of the stage's metrics.jsonl (its last step, with the final validation)."""
    path = run_dir / "metrics.jsonl"
    rows = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return json.loads(rows[-1]) if rows else {}


def check_run_dir(run_dir: Path, stages: list[Stage]) -> dict[int, dict[str, Any]]:
    """The markers of the finished stages, by stage number, after refusing a run directory that this recipe
    cannot continue: one that is not a recipe's, a stage directory the recipe does not have, a finished stage
    after an unfinished one, a finished stage whose config changed, or finished weights a later stage needs
    that are gone."""
    if run_dir.is_dir() and any(run_dir.iterdir()) and not (run_dir / "recipe.yaml").is_file():
        raise ConfigError(
            f"run directory {run_dir} holds something other than a recipe's run (it has no recipe.yaml); "
            "choose another run_dir (--run-dir)"
        )
    expected = {stage_dir_name(s.number, s.name) for s in stages}
    stages_dir = run_dir / "stages"
    if stages_dir.is_dir():
        for path in sorted(stages_dir.iterdir()):
            if path.is_dir() and not path.name.startswith(".") and path.name not in expected:
                raise ConfigError(
                    f"{path} is not a stage of this recipe (were stages renamed, reordered or removed?); "
                    "finish it with the recipe that made it, or use a new run_dir (--run-dir)"
                )
    markers = {s.number: m for s in stages if (m := read_marker(s)) is not None}
    for stage in stages:
        marker = markers.get(stage.number)
        if marker is None:
            later = [s for s in stages if s.number > stage.number and s.number in markers]
            if later:
                raise ConfigError(
                    f"{later[0].label} is finished but {stage.label} is not: the run directory is inconsistent; "
                    "use a new run_dir (--run-dir)"
                )
            continue
        _check_unchanged(stage, marker)
    for stage in stages:
        source = stage.model_from
        if (
            stage.number not in markers
            and source is not None
            and source.number in markers
            and not source.weights.is_dir()
        ):
            raise ConfigError(
                f"{source.label} is finished but its weights {source.weights} are gone, and "
                f"{stage.label} starts from them; use a new run_dir (--run-dir)"
            )
    return markers


def _check_unchanged(stage: Stage, marker: dict[str, Any]) -> None:
    before, now = flatten(marker["config"]), flatten(stage_config(stage))
    for key in sorted(set(before) | set(now)):
        if not key.startswith(IGNORED) and before.get(key) != now.get(key):
            raise ConfigError(
                f"{stage.label} is finished with {key}={before.get(key)!r}, but the recipe now gives {now.get(key)!r}; "
                "its weights (and every later stage's) would not match the recipe: restore the setting, or use a new "
                "run_dir (--run-dir) to run the changed recipe from the start"
            )


def write_summary(run_dir: Path, markers: dict[int, dict[str, Any]]) -> Path:
    """RUN_DIR/recipe.jsonl: one line per finished stage, in order (rewritten whole, atomically)."""
    lines = []
    for number in sorted(markers):
        marker = markers[number]
        lines.append(
            json.dumps(
                {
                    key: marker[key]
                    for key in (
                        "number",
                        "stage",
                        "algorithm",
                        "run_dir",
                        "weights",
                        "duration_s",
                        "finished_at",
                        "config_sha256",
                        "metrics",
                    )
                }
            )
        )
    path = run_dir / "recipe.jsonl"
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path
