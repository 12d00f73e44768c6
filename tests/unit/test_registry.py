"""The table of recipes (loops/registry.py): each root config names the recipe it belongs to, each recipe names what
of algorithms/ its loop calls (an RL recipe a learner factory, a supervised recipe its `SupervisedRecipe`) and the
loop that runs it (no recipe runs itself), and `recipe_of` finds a config's recipe by its class."""

import inspect

from reinforge.algorithms.learner import LearnerParts
from reinforge.algorithms.supervised_recipe import SupervisedRecipe
from reinforge.loops.registry import LOOPS, RECIPES, _load, recipe_of


def test_each_root_config_names_its_recipe_and_is_found_by_its_class():
    for name, recipe in RECIPES.items():
        assert recipe.config_class.recipe == name
        assert recipe_of(recipe.config_class.model_construct()) is recipe


def test_each_rl_recipe_is_a_learner_factory_of_algorithms_run_by_the_rl_loop():
    for name in ("grpo", "ppo", "distill"):
        recipe = RECIPES[name]
        assert recipe.rl and recipe.loop == "rl" and recipe.loop in LOOPS
        assert recipe.learner_path.startswith("reinforge.algorithms.")
        factory = _load(recipe.learner_path)
        assert list(inspect.signature(factory).parameters) == ["config", "parts"]
        assert inspect.signature(factory).parameters["parts"].annotation in (LearnerParts, "LearnerParts")


def test_sft_dpo_and_rm_are_supervised_recipes_run_by_the_supervised_loop():
    for name in ("sft", "dpo", "rm"):
        recipe = RECIPES[name]
        assert (
            not recipe.rl and recipe.loop == "supervised" and LOOPS["supervised"] == "reinforge.loops.supervised:train"
        )
        assert recipe.learner_path.startswith("reinforge.algorithms.")
        assert issubclass(_load(recipe.learner_path), SupervisedRecipe)
