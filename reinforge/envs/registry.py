"""Building environments from config by name."""

from __future__ import annotations

from reinforge.config.schema import EnvConfig
from reinforge.envs.base import Environment
from reinforge.errors import ConfigError


def build_env(name: str, config: EnvConfig) -> Environment:
    """The built-in environment called `name`, configured by `config.<name>`."""
    if name == "math":
        from reinforge.envs.math_env import MathEnv

        return MathEnv(timeout_s=config.math.timeout_s)
    raise ConfigError(f"unknown environment {name!r}; built-in environments: {', '.join(ENV_NAMES)}")


ENV_NAMES = ("math",)


def build_envs(config: EnvConfig) -> dict[str, Environment]:
    """Environments by task name; records pick one with their `task` field."""
    return {"math": build_env("math", config)}
