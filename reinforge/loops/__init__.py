"""The loops that run the recipes of algorithms/: the RL loop and the supervised loop, and their machinery
(building a run's parts, checkpoints and resume, refit, the run's checks)."""
