"""From a recipe to one validated config per stage, and the stage's training call.

A stage's config is built like a `reinforge <algorithm> --config FILE key=value` run's: the stage's
config file (or the recipe's `base`), then the recipe's `overrides`, the stage's `overrides`, the
command line's `key=value`s, all through `config/loader.py` (same key checks, same one-line errors),
against the algorithm's own root schema. Then the recipe sets what chains the stages:

- `logging.run_dir` = RUN_DIR/stages/<kk>-<name>;
- `model.name_or_path` = the final weights (`<stage run dir>/final`, or `merged` for a LoRA stage, whose
  final/ is an adapter: the runner merges it into its base) of the nearest earlier stage that trains a
  policy (every algorithm but `rm`, whose reward model is not a policy); stage 1, and a stage with no
  policy stage before it, keep the config's model;
- `checkpoint.save_final` = true for every stage but the last, whose setting is kept;
- `checkpoint.resume` = auto for the RL stages (grpo, ppo, distill), so a rerun continues from the newest checkpoint.

Nothing here loads a model or touches the hub: `--validate` runs exactly this.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from reinforge.config.loader import build_config, parse_override, read_yaml_tree
from reinforge.config.section import Section
from reinforge.config.tree import deep_merge, set_dotted
from reinforge.data.sources import names_a_missing_file
from reinforge.errors import ConfigError, ReinforgeError
from reinforge.loops.registry import RECIPES, Recipe
from reinforge.modeling import model_location
from reinforge.recipes.spec import RecipeSpec, StageSpec, config_file, dotted_keys, expand_overrides


@dataclass
class Stage:
    number: int  # 1-based, as the console says "stage k of n"
    total: int
    spec: StageSpec
    config: Section  # the validated config the stage trains with
    run_dir: Path  # RUN_DIR/stages/<kk>-<name>
    model_from: "Stage | None"  # the stage whose final weights it starts from; None: the config's model

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def algorithm(self) -> str:
        return self.spec.algorithm

    @property
    def label(self) -> str:
        return f"stage {self.number} of {self.total} ({self.name}, {self.algorithm})"

    @property
    def weights(self) -> Path | None:
        """Where the stage's final policy goes as a whole model (None when it saves none): final/, or for a
        LoRA stage merged/ (final/ then holds its adapter)."""
        if not self.config.checkpoint.save_final:
            return None
        return self.run_dir / ("merged" if getattr(self.config.model, "lora", None) else "final")

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.algorithm]

    @property
    def max_steps(self) -> int:
        return self.recipe.max_steps(self.config)

    def train_fn(self) -> Callable[[Section], Any]:
        return self.recipe.train


def stage_dir_name(number: int, name: str) -> str:
    return f"{number:02d}-{name}"


def build_stages(recipe: RecipeSpec, recipe_path: Path, run_dir: Path, cli_overrides: list[str] = ()) -> list[Stage]:
    """Every stage's validated config, in order; the first problem in any stage is a one-line error."""
    stages: list[Stage] = []
    recipe_tree = expand_overrides(recipe.overrides)
    for number, spec in enumerate(recipe.stages, start=1):
        where = f"recipe {recipe_path}, stage {number} ({spec.name})"
        previous = next((s for s in reversed(stages) if s.recipe.policy), None)
        stage_tree = expand_overrides(spec.overrides)
        _refuse_recipe_owned_keys(where, recipe_tree, stage_tree, cli_overrides, chained=previous is not None)
        schema = RECIPES[spec.algorithm].config_class
        source = spec.config or recipe.base
        try:
            tree = read_yaml_tree(config_file(source, recipe_path)) if source else {}
            deep_merge(tree, copy.deepcopy(recipe_tree))  # copies: merging shares the nested dicts
            deep_merge(tree, copy.deepcopy(stage_tree))
            for text in cli_overrides:
                set_dotted(tree, *parse_override(text, schema))
            stage_run_dir = run_dir / "stages" / stage_dir_name(number, spec.name)
            set_dotted(tree, "logging.run_dir", str(stage_run_dir))
            if previous is not None:
                set_dotted(
                    tree,
                    "model.name_or_path",
                    str(previous.run_dir / ("merged" if previous.config.model.lora else "final")),
                )
            if number < len(recipe.stages):
                set_dotted(tree, "checkpoint.save_final", True)
            set_dotted(tree, "checkpoint.resume", "auto")  # every recipe is checkpointed: an unfinished stage resumes
            config = build_config(tree, schema)
            if previous is None:
                model_location(config.model)  # a local directory that exists, or a hub id (not fetched)
            _check_data_files(config)
        except ReinforgeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        stages.append(Stage(number, len(recipe.stages), spec, config, stage_run_dir, previous))
    return stages


def _refuse_recipe_owned_keys(
    where: str, recipe_tree: dict, stage_tree: dict, cli_overrides: list[str], chained: bool
) -> None:
    """Settings the recipe sets itself may not be overridden: it would silently win over them."""
    keys = (
        set(dotted_keys(recipe_tree))
        | set(dotted_keys(stage_tree))
        | {text.partition("=")[0].strip() for text in cli_overrides}
    )
    if "logging.run_dir" in keys:
        raise ConfigError(
            f"{where}: logging.run_dir is set by the recipe (RUN_DIR/stages/<kk>-<name>); "
            "remove it and set the recipe's run_dir (or --run-dir) instead"
        )
    if chained and "model.name_or_path" in dotted_keys(stage_tree):
        raise ConfigError(
            f"{where}: model.name_or_path is set by the recipe: this stage starts from the previous "
            "stage's final weights; remove it (the first stage's model comes from base, config or overrides)"
        )


def _check_data_files(config: Section) -> None:
    """Every stage's data files exist now, so that a typo in stage 3 does not wait for stages 1 and 2 (a hub dataset
    name is read when its stage starts)."""
    for key in ("train_path", "val_path"):
        value = getattr(config.data, key, None)
        if value and names_a_missing_file(value):
            raise ConfigError(f"data.{key}={value} does not exist; check the path")
