"""Every recipe `reinforge` runs, by name: its root config class and its training function (imported on use, so
that a command loads only its own recipe), and what a multi-stage recipe needs to know of it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Recipe:
    name: str
    config_path: str  # "module:RootConfig"
    train_path: str  # "module:train", taking the root config
    rl: bool  # a recipe of the RL loop: checkpointed, resumable, its length `loop.max_steps`
    policy: bool  # its final/ is a causal LM that a next stage can start from

    @property
    def config_class(self) -> type:
        return _load(self.config_path)

    @property
    def train(self) -> Callable[[Any], Any]:
        return _load(self.train_path)

    def max_steps(self, config: Any) -> int:
        """The number of steps the recipe runs: the RL loop's, or the recipe section's own."""
        return config.loop.max_steps if self.rl else getattr(config, self.name).max_steps


def _load(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


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
        Recipe("sft", "reinforge.algorithms.sft:SFTRunConfig", "reinforge.algorithms.sft:train", False, True),
        Recipe("dpo", "reinforge.algorithms.dpo:DPORunConfig", "reinforge.algorithms.dpo:train", False, True),
        Recipe("rm", "reinforge.algorithms.rm:RMRunConfig", "reinforge.algorithms.rm:train", False, False),
    )
}
