"""The recipe file: where the run goes and the stages it chains.

    run_dir: runs/deepscaler          # RUN_DIR; stage k runs in RUN_DIR/stages/<kk>-<name>
    base: ../grpo_demo.yaml           # optional: the config every stage starts from
    overrides: {loop.max_steps: 3}    # optional: applied to every stage
    stages:
      - name: 8k
        algorithm: grpo               # grpo (default), ppo, distill, sft, dpo or rm
        config: other.yaml            # optional: replaces `base` for this stage
        overrides: {generation.max_new_tokens: 8192}

Overrides are dotted keys (`loop.max_steps: 3`), nested mappings (`loop: {max_steps: 3}`) or both; they
are type-checked against the stage algorithm's config schema when the stages are built (`stages.py`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, model_validator

from reinforge.config.loader import read_yaml_mapping
from reinforge.config.section import Section
from reinforge.config.tree import deep_merge
from reinforge.errors import ConfigError
from reinforge.paths import resolve_path

STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class StageSpec(Section):
    name: str
    """Short name, unique in the recipe; the stage runs in RUN_DIR/stages/<kk>-<name>."""
    algorithm: Literal["grpo", "ppo", "distill", "sft", "dpo", "rm"] = "grpo"
    """The stage's recipe: `reinforge grpo`, `ppo`, `distill`, `sft`, `dpo` or `rm`."""
    config: str | None = None
    """Config file for this stage instead of the recipe's `base` (relative to the recipe file, the
    working directory or the project root)."""
    overrides: dict[str, Any] = {}
    """Settings for this stage on top of the recipe's `overrides`: `section.key: value` or nested mappings."""


class RecipeSpec(Section):
    run_dir: str
    """RUN_DIR: recipe.yaml, recipe.jsonl (per-stage final metrics) and stages/<kk>-<name>/ per stage.
    Rerunning the recipe with the same RUN_DIR skips finished stages and resumes the unfinished one."""
    base: str | None = None
    """Config file every stage starts from unless it names its own `config`; null: the schema's defaults."""
    overrides: dict[str, Any] = {}
    """Settings applied to every stage (before each stage's own overrides)."""
    stages: list[StageSpec]
    """The stages in order; each after the first starts from the previous policy stage's final weights."""

    @model_validator(mode="after")
    def _check_stages(self) -> "RecipeSpec":
        if not self.stages:
            raise ValueError("stages is empty; list at least one stage (name, algorithm, overrides)")
        seen = set()
        for number, stage in enumerate(self.stages, start=1):
            if not STAGE_NAME.fullmatch(stage.name):
                raise ValueError(
                    f"stage {number} name {stage.name!r} must be letters, digits, '_', '-' or '.', "
                    "as it names a directory"
                )
            if stage.name in seen:
                raise ValueError(f"stage name {stage.name!r} is used twice; give every stage its own name")
            seen.add(stage.name)
        return self


def load_recipe(path: str | Path) -> RecipeSpec:
    """Read and validate a recipe file, with one-line errors that name the bad key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file {path} does not exist")
    tree = read_yaml_mapping(path, "recipe file", "a mapping with run_dir and stages")
    try:
        return RecipeSpec.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(f"recipe file {path}: {_describe(exc)}") from None


def expand_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """A nested tree from a mapping whose keys may be dotted (`a.b: 1`) and whose values may be mappings."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        *sections, leaf = str(key).split(".")
        node = tree
        for part in sections:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if isinstance(value, dict):
            value = expand_overrides(value)
            if isinstance(node.get(leaf), dict):
                deep_merge(node[leaf], value)
                continue
        node[leaf] = value
    return tree


def dotted_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf key of a nested tree, dotted."""
    keys = []
    for key, value in tree.items():
        keys += dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"]
    return keys


def config_file(name: str, recipe_path: Path) -> Path:
    """A config named in a recipe: relative to the recipe file first, then as `resolve_path` finds it."""
    beside = recipe_path.parent / name
    path = beside if beside.is_file() else resolve_path(name)
    if not path.is_file():
        raise ConfigError(
            f"config file {name} does not exist (looked beside the recipe, in the working directory "
            "and in the project root)"
        )
    return path


def _describe(exc: ValidationError) -> str:
    errors = exc.errors()  # an unknown key first: a misspelt required key is also reported missing
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    if first["type"] == "extra_forbidden":
        model = _model_at(first["loc"][:-1])
        match = difflib.get_close_matches(str(first["loc"][-1]), list(model.model_fields), n=1, cutoff=0.5)
        hint = f"did you mean {match[0]}?" if match else f"the keys are {', '.join(model.model_fields)}"
        return f"unknown key {where}; {hint}"
    if first["type"] == "missing":
        return f"{where} is required"
    if first["type"] == "value_error":
        return first["msg"].removeprefix("Value error, ")
    return f"{where}: {first['msg']} (got {first.get('input')!r})"


def _model_at(loc: tuple) -> type[BaseModel]:
    return StageSpec if any(part == "stages" for part in loc) else RecipeSpec
