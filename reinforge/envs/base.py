"""The environment interface.

An environment scores a batch of conversations and may continue them. Each request carries the
conversation so far (the last message is the policy's answer) and the dataset record it came from
(ground truth, tests, instructions). The verifier logic lives in plain classes like these; the
cluster layer may wrap them in actors or serve them over HTTP, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass
class EnvRequest:
    """One trajectory to score."""

    messages: list[dict[str, str]]  # chat messages; the last one is the assistant's response
    record: dict[str, Any]  # the dataset record: "answer", "tests", ... whatever the env needs
    episode_id: str = ""  # the trajectory's id, the same on each of its turns (for envs that keep a session)
    last_turn: bool = False  # the rollout stops after this turn whatever the answer: score what there is


@dataclass
class EnvResponse:
    """The environment's verdict on one trajectory."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)  # named parts of the reward
    done: bool = True  # False: `observation` is appended and the policy takes another turn
    observation: list[dict[str, str]] | None = None  # messages to append when not done
    info: dict[str, Any] = field(default_factory=dict)  # per-sample facts, e.g. {"extracted": "42"}
    mask_sample: bool = False  # True: not trained on (its reward still counts in its group's baseline)
    infra_failure: str | None = None
    """Set when the environment's own machinery failed, not the policy's answer: `env_server` (a server
    that kept failing), `timeout` (one that did not answer in time), `sandbox` (the sandbox itself crashed
    or was killed from outside). The reward then means nothing: the rollout retries the episode and masks
    it if it keeps failing (docs/environments.md); `info["infra_error"]` says what happened, in one line."""


@dataclass
class Tool:
    """A function the policy may call with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    run: Callable[[dict[str, Any]], str]  # arguments -> observation text; raises ValueError on bad arguments


class Environment(Protocol):
    """Scores (and optionally continues) a batch of conversations.

    An environment that offers tools to the policy also has `tools: dict[str, Tool]`; the HTTP server
    exposes each one as `POST /tools/{name}`.
    """

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        """Return one response per request, in order. Never raises for a bad model answer; a failure of the
        environment's own infrastructure is a response with `infra_failure` set, never a reward of 0."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (e.g. verifier errors and timeouts), then reset them."""
        ...

    def close(self) -> None:
        """Release processes and connections."""
        ...
