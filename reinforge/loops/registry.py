"""Every recipe `reinforge` runs, by name, and `train(config)`, which runs the recipe a root config belongs to.

A recipe of algorithms/ never runs itself: the table names its root config class, the loop that runs it and the
learner factory that loop calls (what the recipe does with each step's data: the RL loop's `make_learner`, the
supervised loop's recipe class), all as "module:attribute" strings imported on use, so that a command loads only its
own recipe.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# The loops, by name: each takes (root config, learner factory, **options).
LOOPS = {"rl": "reinforge.loops.rl_loop:run", "supervised": "reinforge.loops.supervised:train"}


@dataclass(frozen=True)
class Recipe:
    name: str
    config_path: str  # "module:RootConfig"; the class's `recipe` ClassVar is `name`
    policy: bool  # its final/ is a causal LM that a next stage can start from
    loop: str  # the loop of LOOPS that runs it
    learner_path: str  # what the loop calls: "module:make_learner" (RL), "module:RecipeClass" (supervised)
    check_path: str | None = None  # "module:check", taking the root config: one-line errors before any run directory

    @property
    def config_class(self) -> type:
        return _load(self.config_path)

    @property
    def rl(self) -> bool:
        """A recipe of the RL loop (its length `loop.max_steps`), else of the supervised loop (its section's)."""
        return self.loop == "rl"

    def train(self, config: Any, **options: Any) -> Any:
        """Run the recipe on its root `config`; `options` are the loop's (the RL loop's `on_step_end`)."""
        if self.check_path:
            _load(self.check_path)(config)
        return _load(LOOPS[self.loop])(config, _load(self.learner_path), **options)

    def max_steps(self, config: Any) -> int:
        """The number of steps the recipe runs: the RL loop's, or the recipe section's own."""
        return config.loop.max_steps if self.rl else getattr(config, self.name).max_steps


def _load(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _rl(name: str, config_path: str, learner_path: str, check_path: str | None = None) -> Recipe:
    return Recipe(name, config_path, policy=True, loop="rl", learner_path=learner_path, check_path=check_path)


def _supervised(name: str, root: str, recipe_class: str, policy: bool) -> Recipe:
    """A recipe of the supervised loop: its root in algorithms/<name>_config.py, its recipe class in <name>.py."""
    module = f"reinforge.algorithms.{name}"
    return Recipe(name, f"{module}_config:{root}", policy, loop="supervised", learner_path=f"{module}:{recipe_class}")


RECIPES = {
    recipe.name: recipe
    for recipe in (
        _rl("grpo", "reinforge.algorithms.grpo_config:GRPORunConfig", "reinforge.algorithms.grpo:grpo_learner"),
        _rl("ppo", "reinforge.algorithms.ppo_config:PPORunConfig", "reinforge.algorithms.ppo:ppo_learner"),
        _rl(
            "distill",
            "reinforge.algorithms.distill_config:DistillRunConfig",
            "reinforge.algorithms.distill:distill_learner",
            check_path="reinforge.algorithms.distill:check_distill",
        ),
        _supervised("sft", "SFTRunConfig", "SFT", policy=True),
        _supervised("dpo", "DPORunConfig", "DPO", policy=True),
        _supervised("rm", "RMRunConfig", "RM", policy=False),
    )
}


def recipe_of(config: Any) -> Recipe:
    """The recipe whose root config `config` is (its class's `recipe`)."""
    return RECIPES[type(config).recipe]


def train(config: Any, on_step_end: Callable[[int], None] | None = None) -> Any:
    """Run the recipe that `config` (a root config of algorithms/) belongs to, on its loop. `on_step_end`: the RL
    loop's hook, for tools that observe or pace it (loops/rl_loop.run)."""
    options = {} if on_step_end is None else {"on_step_end": on_step_end}
    return recipe_of(config).train(config, **options)
