"""An environment served over HTTP (http_server.py), used like a local one.

`RemoteEnvironment` implements the `Environment` protocol by calling `POST /verify` in batches of
`batch_size`, `GET /metrics`, and `GET /tools` then `POST /tools/{name}` for each tool.

Failures: a connection error, a timeout, a 5xx answer, HTTP 408 or 429 is retried up to `max_retries` times,
waiting the server's `Retry-After` when it sent one, else `backoff_s`, then twice as long before each further
retry, all within `deadline_s` of the call's start (envs/http_calls.py: an answer still trickling in at the
deadline is a timeout too). After that, `/verify` answers each trajectory of that batch with an infrastructure
failure (`EnvResponse.infra_failure`: `timeout` when the last try timed out, else `env_server`;
`info["infra_error"]` names the URL and the last cause), which the rollout retries and masks
(docs/environments.md), and the other routes raise `EnvServerUnavailable` with the same line. Any other 4xx
answer (bad token, a record the environment cannot score, a request over the server's size limit) is not
retried: it fails at once with the server's message. So a call never hangs: it ends within `deadline_s` plus
at most one wait of `timeout_s`. A retried `/verify` may count a batch twice in the server's metrics; tool calls
are retried too, so a tool with side effects should make them idempotent.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import httpx
from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.envs.base import EnvRequest, EnvResponse, Tool
from reinforge.envs.http_calls import one_line, retry_after_s, retry_wait, retryable_status, send_within
from reinforge.errors import ConfigError, ReinforgeError


class EnvServerError(ReinforgeError):
    """An environment server that cannot be reached, keeps failing, or rejects a request."""


class EnvServerUnavailable(EnvServerError):
    """A server that kept failing (`kind` env_server) or not answering in time (`kind` timeout), retries included."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class RemoteEnvConfig(Section):
    url: str = ""
    """Base URL of a `reinforge env serve` server, e.g. http://127.0.0.1:8100; empty: run the environment in-process."""
    token_env: str = ""
    """Name of the environment variable holding the server's bearer token; empty: send no token."""
    timeout_s: float = 60.0
    """Time limit for connecting, sending, and each wait for the server's answer to one batch."""
    max_retries: int = 8
    """Retries after a connection error, a timeout, a 5xx answer, HTTP 408 or 429 (the default rides out about a
    minute and a half of outage); then the batch's trajectories are infrastructure failures (retried by the
    rollout, `rollout.max_infra_retries`)."""
    backoff_s: float = 0.5
    """Wait before the first retry; each further retry waits twice as long, at most 30 s (a server's Retry-After
    replaces it)."""
    deadline_s: float = 300.0
    """The most one call may take, its retries and their waits included: a server that trickles its answer or keeps
    failing is an infrastructure failure by then."""
    batch_size: int = 256
    """Most trajectories per POST /verify; a larger step is split into several calls."""

    @model_validator(mode="after")
    def _check_ranges(self) -> "RemoteEnvConfig":
        checks = [
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (self.max_retries >= 0, "max_retries must be >= 0 (0: no retries)"),
            (self.backoff_s >= 0, "backoff_s must be >= 0"),
            (self.deadline_s > 0, "deadline_s must be > 0"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"remote environment {message}")
        return self


class RemoteEnvironment:
    """The environment served at `url`; see the module doc for retries and time bounds."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        batch_size: int,
        deadline_s: float = 300.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"environment server URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self.deadline_s = deadline_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    @classmethod
    def from_config(cls, config: RemoteEnvConfig) -> "RemoteEnvironment":
        token = None
        if config.token_env:
            token = os.environ.get(config.token_env)
            if not token:
                raise ConfigError(
                    f"token_env names the environment variable {config.token_env}, which is unset or empty; "
                    "export the server's token in it"
                )
        return cls(
            config.url,
            token=token,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            batch_size=config.batch_size,
            deadline_s=config.deadline_s,
        )

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        responses = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            body = {
                "requests": [
                    {"messages": r.messages, "record": r.record, "episode_id": r.episode_id, "last_turn": r.last_turn}
                    for r in batch
                ]
            }
            try:
                results = self._call("POST", "/verify", body)["responses"]
            except EnvServerUnavailable as exc:  # the server's failure, not the answers': no reward at all
                responses.extend(
                    EnvResponse(reward=0.0, infra_failure=exc.kind, info={"infra_error": str(exc)}) for _ in batch
                )
                continue
            if len(results) != len(batch):
                raise EnvServerError(
                    f"environment server {self.url} answered {len(results)} responses to {len(batch)} requests"
                )
            responses.extend(EnvResponse(**result) for result in results)
        return responses

    def metrics(self) -> dict[str, float]:
        """The server's counters; `metrics_unavailable` 1 (and none of them) when it kept failing: those
        counters are lost, the run goes on."""
        try:
            return self._call("GET", "/metrics")["metrics"]
        except EnvServerUnavailable:
            return {"metrics_unavailable": 1.0}

    @functools.cached_property
    def tools(self) -> dict[str, Tool]:
        """The server's tools, fetched once; each `run` is a `POST /tools/{name}`."""
        specs = self._call("GET", "/tools")["tools"]
        return {
            spec["name"]: Tool(
                name=spec["name"],
                description=spec["description"],
                parameters=spec["parameters"],
                run=functools.partial(self._run_tool, spec["name"]),
            )
            for spec in specs
        }

    def close(self) -> None:
        self._client.close()

    def _run_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return self._call("POST", f"/tools/{name}", {"arguments": arguments})["observation"]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON answer to one call, retried per the module doc."""
        deadline = time.monotonic() + self.deadline_s
        cause, kind, retry_after, attempts = "", "env_server", None, 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                wait = retry_wait(attempt, self.backoff_s, retry_after, deadline)
                if wait is None:
                    cause += f" (no time left for another attempt within deadline_s={self.deadline_s:g})"
                    break
                time.sleep(wait)
            attempts += 1
            retry_after = None
            try:
                response = send_within(self._client, method, path, deadline, json=body)
            except httpx.TransportError as exc:  # refused, reset, timed out, disconnected, trickling past the deadline
                cause = f"{type(exc).__name__}: {one_line(exc)}"
                kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "env_server"
                continue
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError:
                    raise EnvServerError(
                        f"{self.url}{path} answered with something other than JSON; is it a reinforge env server?"
                    ) from None
            cause, kind = f"HTTP {response.status_code}: {_detail(response)}", "env_server"
            if not retryable_status(response.status_code):
                raise EnvServerError(f"environment server {self.url} rejected {method} {path}: {cause}")
            retry_after = retry_after_s(response)
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        raise EnvServerUnavailable(f"environment server {self.url} failed {method} {path} after {tries}: {cause}", kind)


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    return one_line(detail if isinstance(detail, str) else response.text[:200] or response.reason_phrase)
