"""Building the environments a run needs from config."""

from __future__ import annotations

from reinforge.config.schema import EnvConfig
from reinforge.envs.base import Environment
from reinforge.envs.math_env import MathEnv


def build_envs(config: EnvConfig) -> dict[str, Environment]:
    """Environments by task name; records pick one with their `task` field."""
    return {"math": MathEnv(timeout_s=config.math.timeout_s)}
