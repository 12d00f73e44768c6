"""The loops that run the recipes of algorithms/: the RL loop and the supervised loop, and their machinery
(building a run's parts, checkpoints and resume, refit, the run's checks). `train(config)` runs the recipe a root
config belongs to (registry.py names each recipe's loop and learner)."""

from reinforge.loops.registry import train

__all__ = ["train"]
