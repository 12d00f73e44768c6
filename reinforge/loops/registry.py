"""Every recipe `reinforge` runs, by name: its root config class and its training function (imported on use, so
that a command loads only its own recipe), and what a multi-stage recipe needs to know of it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable


@dataclass(frozen=True)
class Recipe:
    name: str
    config_path: str  # "module:RootConfig"
    train_path: str  # "module:train", taking the root config
    rl: bool  # a recipe of the RL loop (its length `loop.max_steps`), else of the supervised loop
    policy: bool  # its final/ is a causal LM that a next stage can start from
    recipe_path: str | None = None  # "module:Recipe": what the loop at train_path runs (its `make_recipe`)

    @property
    def config_class(self) -> type:
        return _load(self.config_path)

    @property
    def train(self) -> Callable[[Any], Any]:
        loop = _load(self.train_path)
        return partial(loop, make_recipe=_load(self.recipe_path)) if self.recipe_path else loop

    def max_steps(self, config: Any) -> int:
        """The number of steps the recipe runs: the RL loop's, or the recipe section's own."""
        return config.loop.max_steps if self.rl else getattr(config, self.name).max_steps


def _load(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


SUPERVISED = "reinforge.loops.supervised:train"  # the loop of SFT, DPO and RM
RECIPES = {
    recipe.name: recipe
    for recipe in (
        Recipe("grpo", "reinforge.algorithms.grpo:GRPORunConfig", "reinforge.algorithms.grpo:train", True, True),
        Recipe("ppo", "reinforge.algorithms.ppo_config:PPORunConfig", "reinforge.algorithms.ppo:train", True, True),
        Recipe(
            "distill",
            "reinforge.algorithms.distill_config:DistillRunConfig",
            "reinforge.algorithms.distill:train",
            True,
            True,
        ),
        Recipe("sft", "reinforge.algorithms.sft:SFTRunConfig", SUPERVISED, False, True, "reinforge.algorithms.sft:SFT"),
        Recipe("dpo", "reinforge.algorithms.dpo:DPORunConfig", SUPERVISED, False, True, "reinforge.algorithms.dpo:DPO"),
        Recipe("rm", "reinforge.algorithms.rm:RMRunConfig", SUPERVISED, False, False, "reinforge.algorithms.rm:RM"),
    )
}
