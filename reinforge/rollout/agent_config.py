"""Who drives an agent episode, and how it is bounded (`rollout.driver=agent`): the `agent` config section.

Kept apart from rollout/agent.py so that the config schema can import it without the rollout's code.
"""

from __future__ import annotations

from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.serving.config import ServingConfig


class GymAgentConfig(Section):
    url: str = ""
    """Base URL of a NeMo Gym agent server (e.g. its `simple_agent`), which gets `POST {url}/run` per episode.
    Its model server (Gym's `vllm_model`) must point at this run's endpoint (`agent.endpoint`)."""


class AgentConfig(Section):
    python: dict[str, str] = {}
    """Your own agents: name -> `module:function`, called once per episode with the endpoint's `base_url`
    and the record (docs/agents.md); it returns the reward, or a dict with `reward`, `reward_components`,
    `mask_sample`."""
    gym: dict[str, GymAgentConfig] = {}
    """NeMo Gym agent servers: name -> {url}."""
    default: str = ""
    """The agent of records that name none (`agent_ref.name`, or an `agent` field); empty: the only agent configured."""
    servers: dict[str, str] = {}
    """URLs handed to Python agents as `servers` (e.g. resources servers): name -> URL."""
    serve_envs: dict[str, str] = {}
    """Environments this run serves as NeMo Gym resources servers on loopback for its agents: name ->
    environment (built in, e.g. tool_use, or `module:Class`); each URL joins `servers` under its name."""
    timeout_s: float = 300.0
    """An episode that has not ended after this long is abandoned: masked, counted
    (rollout/agent_timeout_fraction), never waited for again."""
    first_call_timeout_s: float = 30.0
    """A rollout of Gym agents whose episodes have sent the policy endpoint no request at all after this long
    stops with one line: their model server (Gym's vllm_model) points elsewhere. Raise it for agents that set up
    for longer before their first model call (a container per episode); 0: wait agent.timeout_s."""
    max_concurrency: int = 256
    """Most episodes in flight at once."""
    max_retries: int = 3
    """Retries of a Gym agent server that cannot be reached (refused, reset, timed out) or answers 429; then the
    episode is an infrastructure failure, run again and then masked (docs/reliability.md)."""
    backoff_s: float = 0.5
    """Wait before the first retry; each further retry waits twice as long (a 429's Retry-After replaces it)."""
    endpoint: ServingConfig = ServingConfig()
    """The policy's OpenAI-compatible endpoint that agents call (serving/)."""

    @model_validator(mode="after")
    def _check(self) -> "AgentConfig":
        names = [*self.python, *self.gym]
        checks = [
            (self.timeout_s > 0, "agent.timeout_s must be > 0"),
            (self.first_call_timeout_s >= 0, "agent.first_call_timeout_s must be >= 0"),
            (self.max_concurrency >= 1, "agent.max_concurrency must be >= 1"),
            (self.max_retries >= 0 and self.backoff_s >= 0, "agent.max_retries and agent.backoff_s must be >= 0"),
            (
                len(names) == len(set(names)),
                f"agent names must be unique across agent.python and agent.gym: {sorted(names)}",
            ),
            (
                not self.default or self.default in names,
                f"agent.default={self.default!r} is not an agent; configured: {', '.join(names) or 'none'}",
            ),
        ]
        for name, path in self.python.items():
            checks.append((":" in path, f"agent.python.{name}={path!r} must be module:function"))
        for name, gym in self.gym.items():
            checks.append(
                (
                    gym.url.startswith(("http://", "https://")),
                    f"agent.gym.{name}.url={gym.url!r} must start with http:// or https://",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    def names(self) -> list[str]:
        return [*self.python, *self.gym]
