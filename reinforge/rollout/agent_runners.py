"""Running one agent episode: a NeMo Gym agent server over HTTP, or your own Python function.

Both run on one asyncio loop (rollout/agent.py), at most `agent.max_concurrency` at a time, each
bounded by `agent.timeout_s`:
- a Gym agent gets `POST {url}/run` with the row, its `responses_create_params` stamped with the
  rollout's `temperature`, `top_p` and `max_output_tokens` (as NeMo-RL stamps every row); the answer
  is Gym's verify result (`reward`, `reward_components`, `mask_sample`, and `response.output`, whose
  items carry the token ids of each model call). A server that cannot be reached, or answers 429 (too
  busy: it has not run the episode) is retried (`agent.max_retries`, exponential `agent.backoff_s`, or the
  server's `Retry-After`); then, like a 5xx answer or an answer that is not JSON (a proxy's error page),
  the episode is an infrastructure failure (`gym_server`: retried from scratch, then masked,
  rollout/infra.py; the run stops with one line naming the server when too many are); another 4xx answer
  fails that episode only: the agent's.
- a Python agent, `module:function`, is called with `base_url` (the endpoint, under this episode's
  own path, so that its calls are recorded as its own) and `record`, plus whichever of `model`,
  `api_key`, `sampling` and `servers` its signature names. A plain function runs on a thread of its
  own (a hung one is abandoned at the timeout, never waited for); an `async def` runs on the loop and
  is cancelled at the timeout. It returns the reward, or a dict with `reward` and optionally
  `reward_components` and `mask_sample`. An exception caused by an HTTP failure (a connection error,
  a timeout or a 5xx answer anywhere in its chain of causes, e.g. openai's APIConnectionError) is an
  infrastructure failure (`http`); any other exception is the agent's own failure (`failed`).

An episode past `agent.timeout_s` is an infrastructure failure too (`timeout`).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from reinforge.data.responses_format import verdict_components
from reinforge.envs.http_calls import retry_after_s, retryable_status
from reinforge.errors import ConfigError

OPTIONAL_ARGUMENTS = ("model", "api_key", "sampling", "servers")


@dataclass
class EpisodeResult:
    """What an agent said of one episode."""

    status: str  # "ok", "failed" (it raised, or answered an error) or "timeout"
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    mask_sample: bool = False
    error: str = ""
    gym_output: list[dict[str, Any]] | None = None  # a Gym agent's response.output items
    infra_failure: str | None = None  # not the policy's: gym_server, http or timeout (rollout/infra.py)


def import_agent(path: str) -> Callable[..., Any]:
    module_name, _, function_name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"agent {path!r}: cannot import it ({_one_line(exc)}); give it as module:function with the module on "
            "PYTHONPATH"
        ) from None
    except Exception as exc:  # the module itself raised as it was imported (a syntax error, a failing import-time line)
        raise ConfigError(
            f"agent {path!r}: importing {module_name} raised {type(exc).__name__}: {_one_line(exc)}; fix the module"
        ) from None
    if not callable(function):
        raise ConfigError(f"agent {path!r} is not a function")
    return function


def parse_result(value: Any, where: str, sent: dict[str, Any] | None = None) -> EpisodeResult:
    """A Python agent's return value, or a Gym verify result, as an EpisodeResult. Its components are
    `verdict_components` of it and the row it was `sent` (Gym's verifiers give
    their counters as top-level fields; NeMo-RL averages them the same way)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {"reward": value}
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("reward"), (int, float))
        or isinstance(value.get("reward"), bool)
    ):
        return EpisodeResult(
            "failed",
            error=f"{where} returned {str(value)[:80]!r}; return the reward, or a dict with a numeric `reward`",
        )
    components = value.get("reward_components") or {}
    if not isinstance(components, dict) or not all(isinstance(v, (int, float)) for v in components.values()):
        return EpisodeResult(
            "failed", error=f"{where}: reward_components must map names to numbers, got {str(components)[:80]!r}"
        )
    components = verdict_components(value, sent or {})
    if not math.isfinite(float(value["reward"])):
        return EpisodeResult("failed", error=f"{where} returned a reward of {value['reward']}")
    return EpisodeResult(
        "ok", reward=float(value["reward"]), components=components, mask_sample=bool(value.get("mask_sample", False))
    )


def stamped_row(record: dict[str, Any], temperature: float, top_p: float, max_tokens: int) -> dict[str, Any]:
    """The row a Gym agent gets: the record, its responses_create_params carrying the rollout's sampling."""
    row = copy.deepcopy(record)
    params = row.setdefault("responses_create_params", {})
    params.update(temperature=temperature, top_p=top_p, max_output_tokens=max_tokens)
    return row


def check_agent_server(name: str, url: str, timeout_s: float = 5.0) -> None:
    """Refuse, at start-up, a Gym server of another kind at `agent.gym.<name>.url` (a resources server, say): every
    episode's `POST /run` would answer 404 only once the model has loaded. Its routes come from FastAPI's
    `/openapi.json`; a server that does not answer, or lists no routes, is left to the episodes (retried, named)."""
    try:
        paths = set(httpx.get(f"{url.rstrip('/')}/openapi.json", timeout=timeout_s).json().get("paths") or {})
    except (httpx.HTTPError, ValueError, AttributeError):
        return
    if paths and "/run" not in paths:
        shown = ", ".join(sorted(paths)[:6])
        raise ConfigError(
            f"agent.gym.{name}.url={url} is not a NeMo Gym agent server: it has no /run route (its routes: {shown}); "
            "give the URL of a responses_api_agents server (e.g. simple_agent) whose resources server this is"
        )


class GymAgentRunner:
    def __init__(self, name: str, url: str, timeout_s: float, max_retries: int, backoff_s: float):
        self.name, self.url, self.timeout_s = name, url.rstrip("/"), timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s

    async def run(self, client: httpx.AsyncClient, row: dict[str, Any]) -> EpisodeResult:
        cause, retry_after = "", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(retry_after if retry_after is not None else self.backoff_s * 2 ** (attempt - 1))
            retry_after = None
            try:
                response = await client.post(f"{self.url}/run", json=row, timeout=self.timeout_s)
            except httpx.TransportError as exc:  # refused, reset, cut off, timed out: it may be back next time
                cause = f"{type(exc).__name__}: {_one_line(exc)}"
                continue
            if response.status_code == 429:  # too busy to start it: ask again after the wait it names
                cause, retry_after = f"HTTP 429: {response.text[:200]}", retry_after_s(response)
                continue
            if response.status_code >= 400:
                return EpisodeResult(
                    "failed",
                    error=f"Gym agent {self.name} answered HTTP {response.status_code}: {response.text[:200]}",
                    infra_failure="gym_server" if retryable_status(response.status_code) else None,
                )
            try:
                body = response.json()
            except ValueError:  # a proxy's error page, a server cut off mid-answer: no verdict on the episode
                return EpisodeResult(
                    "failed",
                    error=f"Gym agent {self.name} answered something other than JSON: {response.text[:120]!r}",
                    infra_failure="gym_server",
                )
            result = parse_result(body, f"Gym agent {self.name}", sent=row)
            output = (body.get("response") or {}).get("output") if isinstance(body.get("response"), dict) else None
            result.gym_output = output if isinstance(output, list) else []
            if result.status == "ok" and result.gym_output and not any(_carries_ids(i) for i in result.gym_output):
                result.error = (  # the episode is then `no_calls`: nothing ties it to the endpoint's records
                    f"Gym agent {self.name} reported {len(result.gym_output)} output items and no token ids: set "
                    "`return_token_id_information: true` on its model server (Gym's vllm_model)"
                )
            return result
        tries = f"{self.max_retries + 1} attempt{'s' if self.max_retries else ''}"
        busy = cause.startswith("HTTP 429")
        return EpisodeResult(
            "failed",
            error=f"NeMo Gym agent {self.name} at {self.url} {'was too busy' if busy else 'cannot be reached'} after "
            f"{tries}: {cause}; {'raise agent.max_retries' if busy else 'is it running?'} (agent.gym.{self.name})",
            infra_failure="gym_server",
        )


class PythonAgentRunner:
    def __init__(self, name: str, path: str, timeout_s: float):
        self.name, self.path, self.timeout_s = name, path, timeout_s
        self.function = import_agent(path)
        parameters = inspect.signature(self.function).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.optional = [name for name in OPTIONAL_ARGUMENTS if takes_all or name in parameters]
        self.is_async = inspect.iscoroutinefunction(self.function)

    async def run(self, base_url: str, record: dict[str, Any], context: dict[str, Any]) -> EpisodeResult:
        kwargs = {"base_url": base_url, "record": copy.deepcopy(record), **{k: context[k] for k in self.optional}}
        where = f"agent {self.name} ({self.path})"
        try:
            if self.is_async:
                value = await asyncio.wait_for(self.function(**kwargs), self.timeout_s)
            else:
                value = await asyncio.wait_for(_on_own_thread(self.function, kwargs), self.timeout_s)
        except asyncio.TimeoutError:
            return EpisodeResult(
                "timeout",
                error=f"{where} did not finish within agent.timeout_s={self.timeout_s:g}",
                infra_failure="timeout",
            )
        except Exception as exc:  # this episode fails, the run goes on
            infra = "http" if http_failure(exc) else None
            return EpisodeResult(
                "failed", error=f"{where} raised {type(exc).__name__}: {_one_line(exc)}", infra_failure=infra
            )
        return parse_result(value, where, sent=record)


# Transport failures by class name, so that any httpx (or a fork of it, as some openai builds vendor) and openai's
# own wrappers count: connect, read and write errors and timeouts.
_TRANSPORT_ERRORS = {"TransportError", "APIConnectionError", "APITimeoutError"}


def http_failure(exc: BaseException) -> bool:
    """Whether `exc`, or anything in its chain of causes, is an HTTP failure: a connection error, a timeout,
    or a 5xx, 408 or 429 answer (an exception carrying a `response` with that `status_code`, as httpx's
    HTTPStatusError and openai's APIStatusError do)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError)) or any(
            cls.__name__ in _TRANSPORT_ERRORS for cls in type(exc).__mro__
        ):
            return True
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int) and retryable_status(status):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _on_own_thread(function: Callable[..., Any], kwargs: dict[str, Any]) -> asyncio.Future:
    """`function(**kwargs)` on a daemon thread of its own, as a future of this loop: a thread that hangs
    is left behind (it holds no slot anyone waits for) and dies with the process."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def target() -> None:
        value, error = None, None
        try:
            value = function(**kwargs)
        except BaseException as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the rollout gave up on it and its loop is closed
            pass

    threading.Thread(target=target, name="reinforge-agent", daemon=True).start()
    return future


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _carries_ids(item: Any) -> bool:
    return isinstance(item, dict) and bool(item.get("generation_token_ids"))
