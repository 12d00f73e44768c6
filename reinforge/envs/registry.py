"""Building environments from config by name."""

from __future__ import annotations

import importlib

from reinforge.config.section import Section
from reinforge.envs.base import Environment, EnvRequest, EnvResponse
from reinforge.envs.code_env import CodeEnvConfig
from reinforge.envs.format_env import FormatEnvConfig
from reinforge.envs.gym_config import GymResourcesConfig
from reinforge.envs.http_client import RemoteEnvConfig
from reinforge.envs.ifeval import IfEvalConfig
from reinforge.envs.judge_config import JudgeEnvConfig
from reinforge.envs.math_env import MathEnvConfig
from reinforge.envs.tool_use import ToolUseEnvConfig
from reinforge.errors import ConfigError, DataError


class EnvConfig(Section):
    default_task: str = "math"
    """Environment for records that do not name a `task`."""
    num_workers: int = 0
    """Verifier worker processes (Ray actors, each holding every environment the run uses) that score
    a batch in parallel slices; 0 scores in the driver process."""
    num_cpus_per_worker: float = 1.0
    """CPUs reserved for each verifier worker."""
    math: MathEnvConfig = MathEnvConfig()
    """The `math` environment: answer extraction plus math-verify."""
    code: CodeEnvConfig = CodeEnvConfig()
    """The `code` environment: model-written Python against unit tests in a sandbox."""
    ifeval: IfEvalConfig = IfEvalConfig()
    """The `ifeval` environment: IFEval's 25 verifiable instruction types."""
    format: FormatEnvConfig = FormatEnvConfig()
    """The `format` environment: "detailed thinking on/off" compliance (<think> tags)."""
    judge: JudgeEnvConfig = JudgeEnvConfig()
    """The `judge` environment: an LLM judge or reward model over HTTP, or a local reward model."""
    tool_use: ToolUseEnvConfig = ToolUseEnvConfig()
    """The `tool_use` environment: calculator and sandboxed Python tools, then a scored final answer
    (needs rollout.max_turns > 1)."""
    extra_rewards: dict[str, float] = {}
    """Environments that score every trajectory's final answer on top of its task's, with weights:
    reward = task reward + sum of weight x extra reward; e.g. {format: 0.5} adds reasoning-mode
    compliance to any task. Each appears as a reward component."""
    custom: dict[str, str] = {}
    """Your own environments: task name -> `module:Class` (importable; built with no arguments), e.g.
    `env.custom.sql=my_project.envs:SqlEnv`. See docs/environments.md."""
    remote: dict[str, RemoteEnvConfig] = {}
    """Tasks scored by environment servers (`reinforge env serve`): task name -> server, e.g.
    `env.remote.code.url=http://10.0.0.5:8000`. A remote task may have any name, built in or not."""
    gym: dict[str, GymResourcesConfig] = {}
    """Tasks scored by NeMo Gym resources servers while reinforge drives the model: task name -> server,
    e.g. `env.gym.weather.url=http://127.0.0.1:18001`. The server's tools are called for the policy's
    `<tool_call>`s (its session cookie kept per trajectory), and its /verify scores the episode
    (docs/agents.md). Needs rollout.max_turns > 1 for tools."""


def build_env(name: str, config: EnvConfig) -> Environment:
    """The environment for task `name`: your class when `env.custom.<name>` is set (or `name` is itself
    `module:Class`), a server's when `env.remote.<name>` (a reinforge env server) or `env.gym.<name>` (a
    NeMo Gym resources server) is, else the built-in one configured by `config.<name>`."""
    if name in config.custom or ":" in name:
        return _import_env(config.custom.get(name, name))
    if name in config.gym:
        from reinforge.envs.gym import GymResourcesEnv

        return GymResourcesEnv(config.gym[name])
    if name in config.remote:
        from reinforge.envs.http_client import RemoteEnvironment

        return RemoteEnvironment.from_config(config.remote[name])
    if name == "code":
        from reinforge.envs.code_env import CodeEnv

        return CodeEnv(config.code)
    if name == "ifeval":
        from reinforge.envs.ifeval import IfEvalEnv

        return IfEvalEnv(config.ifeval)
    if name == "format":
        from reinforge.envs.format_env import FormatEnv

        return FormatEnv(config.format)
    if name == "tool_use":
        from reinforge.envs.tool_use import ToolUseEnv

        return ToolUseEnv(config.tool_use, answer_env=build_env(config.tool_use.answer_env, config))
    if name == "judge":
        from reinforge.envs.judge import JudgeEnv

        return JudgeEnv(config.judge)
    if name == "math":
        from reinforge.envs.math_env import MathEnv

        return MathEnv(timeout_s=config.math.timeout_s)
    raise ConfigError(f"unknown environment {name!r}; built-in environments: {', '.join(ENV_NAMES)}")


def _import_env(path: str) -> Environment:
    """Build `module:Class` with no arguments."""
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"environment {path!r}: cannot import it ({exc}); give it as module:Class with the module on PYTHONPATH"
        ) from None
    return cls()


ENV_NAMES = ("math", "code", "ifeval", "format", "judge", "tool_use")


def check_tasks(tasks: set[str], config: EnvConfig) -> None:
    """Fail before any process starts when a record names a task no environment serves."""
    unknown = sorted(tasks - set(ENV_NAMES) - set(config.remote) - set(config.custom) - set(config.gym))
    if unknown:
        raise DataError(
            f"records name task {unknown[0]!r}, which no environment serves; "
            f"built-in environments: {', '.join(ENV_NAMES)}; "
            f"your own environment class needs env.custom.{unknown[0]}=module:Class, "
            f"one served over HTTP env.remote.{unknown[0]}.url, "
            f"a NeMo Gym resources server env.gym.{unknown[0]}.url "
            f"(records without a `task` use env.default_task={config.default_task!r})"
        )


def check_sandboxes(tasks: set[str], config: EnvConfig) -> None:
    """One line before the run directory when an environment that runs model-written code here (`code`,
    `tool_use`'s python tool) cannot isolate it; plain isolation runs only when configured (envs/sandbox.py)."""
    from reinforge.envs.sandbox import check_sandbox_available

    local = tasks - set(config.remote) - set(config.custom) - set(config.gym)
    if "tool_use" in local:
        local.add(config.tool_use.answer_env)
    if "code" in local:
        check_sandbox_available(config.code.sandbox, "env.code.sandbox")
    if "tool_use" in local and "python" in config.tool_use.tools:
        check_sandbox_available(config.tool_use.sandbox, "env.tool_use.sandbox")


def build_envs(config: EnvConfig, tasks: set[str] | None = None) -> dict[str, Environment]:
    """Environments by task name (records pick one with their `task` field); default: the default task."""
    return {task: build_env(task, config) for task in sorted(tasks or {config.default_task})}


class EnvWorker:
    """Every environment a run uses, in one process: what each verifier worker (a Ray actor) holds."""

    def __init__(self, config: EnvConfig, tasks: set[str]):
        self.envs = build_envs(config, tasks)

    def step(self, task: str, requests: list[EnvRequest]) -> list[EnvResponse]:
        return self.envs[task].step(requests)

    def metrics(self) -> dict[str, dict[str, float]]:
        return {task: env.metrics() for task, env in self.envs.items()}

    def close(self) -> None:
        for env in self.envs.values():
            env.close()
