"""Loading a recipe's own config tree (`reinforge sft`, `dpo`, `rm`): the same loader as GRPO's
(`loader.py`), with the recipe's root schema in place of `Config`."""

from reinforge.config.loader import load_recipe_config

__all__ = ["load_recipe_config"]
