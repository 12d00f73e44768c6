"""A NeMo Gym resources server as an `Environment`, while reinforge drives the model (`env.gym.<task>`).

The records are Gym rows (`responses_create_params` + the verifier's fields, data/prompts.py renders
them); the server holds the task's tools and its verifier. Per trajectory (`EnvRequest.episode_id`):

1. The first time an episode is seen, the row is POSTed to `/seed_session`, and the cookies the
   server sets (Gym keys its per-session state by a session cookie) are kept for that episode only.
2. While the policy's last message holds `<tool_call>` blocks and it is not the last turn, each
   call is POSTed to `/<tool name>` with its arguments as the JSON body (and the episode's cookies,
   updated from each answer), and the raw answer body becomes a `tool` message (done=False). As in
   Gym's simple_agent, an HTTP 4xx answer from a tool (a 422 for arguments that fail its schema) is still
   the tool's output: the policy called it wrongly. A 5xx is the server's failure, retried as below. A malformed
   call gets `parse_tool_calls`' error string, a tool the row does not list (or a name that is no
   plain route name) an error naming the tools; neither is sent.
3. Otherwise `{**row, "response": R}` goes to `/verify`, where R is the Responses object of the
   conversation after the row's input (data/responses_format.py: function_call, function_call_output
   and message items); its `reward`, `reward_components` and `mask_sample` are the verdict, and the
   episode's session is forgotten. A record without an episode id is seeded and verified at once.

Fields reinforge adds to a record (e.g. `task`) are sent as they are: Gym's request models allow
extra fields. Connection errors, timeouts, 5xx, 408 and 429 answers to seed, tool calls and verify are
retried `max_retries` times, waiting the server's `Retry-After` when it sent one, else `backoff_s`, then
twice as long before each further retry, all within `deadline_s` of the call's start (an answer still
trickling in then is a timeout, envs/http_calls.py); then the episode is an infrastructure failure
(`EnvResponse.infra_failure` `gym_server`, or `timeout`; `info["infra_error"]` names the server, the route
and the cause), which the rollout runs again with a fresh session (rollout/infra.py), never a reward or an
observation. Another 4xx answer to seed or verify fails at once (`GymServerError`). So a call ends within
`deadline_s` plus at most one wait of `timeout_s`. The trajectories of one `step` run concurrently, at most
`max_concurrency` calls at a time.
"""

from __future__ import annotations

import http.cookiejar
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from reinforge.data.responses_format import chat_to_response, create_params_to_chat, verdict_components
from reinforge.data.tool_calls import ToolCall, parse_tool_calls
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.envs.gym_config import GymResourcesConfig
from reinforge.envs.http_calls import one_line, retry_after_s, retry_wait, retryable_status, send_within
from reinforge.errors import ConfigError, DataError, ReinforgeError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")
GYM_ROUTES = ("seed_session", "close_session", "verify", "aggregate_metrics", "reverify_mode", "health")
COUNTERS = ("seed_calls", "tool_calls", "tool_errors", "verify_calls", "masked")


class GymServerError(ReinforgeError):
    """A NeMo Gym resources server that cannot be reached, keeps failing, or rejects a request."""


class GymServerUnavailable(GymServerError):
    """A server that kept failing (`kind` gym_server) or not answering in time (`kind` timeout), retries included."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class GymResourcesEnv:
    """The resources server at `config.url`; see the module doc."""

    def __init__(self, config: GymResourcesConfig):
        self.url = config.url.rstrip("/")
        self.config = config
        # The client keeps no cookies: each episode's go in its own requests (Gym servers set one per session).
        no_cookies = http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
        self._client = httpx.Client(base_url=self.url, timeout=config.timeout_s, limits=limits, cookies=no_cookies)
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="gym-env")
        self._sessions: dict[str, dict[str, str]] = {}  # episode id -> the server's cookies for it
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        return list(self._pool.map(self._step_or_infra_failure, requests))

    def _step_or_infra_failure(self, request: EnvRequest) -> EnvResponse:
        """The episode's response; a server that kept failing is the episode's infrastructure failure (rollout/infra.py
        runs it again as a new episode, with a fresh session)."""
        try:
            return self._step_one(request)
        except GymServerUnavailable as exc:
            with self._lock:
                self._sessions.pop(request.episode_id, None)
            return EnvResponse(reward=0.0, infra_failure=exc.kind, info={"infra_error": str(exc)})

    def metrics(self) -> dict[str, float]:
        with self._lock:
            counts, self.counts = self.counts, dict.fromkeys(COUNTERS, 0)
        return {name: float(value) for name, value in counts.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def _step_one(self, request: EnvRequest) -> EnvResponse:
        params = request.record.get("responses_create_params")
        if not isinstance(params, dict):
            raise DataError(
                f"NeMo Gym task at {self.url}: its records must be Gym rows with responses_create_params, "
                f"got a record with fields {', '.join(request.record) or 'none'}"
            )
        with self._lock:
            cookies = self._sessions.get(request.episode_id) if request.episode_id else None
        if cookies is None:
            cookies = dict(self._post("seed_session", request.record, {}).cookies)
            self._count("seed_calls")
        last = request.messages[-1]
        calls = parse_tool_calls(last["content"]) if last.get("role") == "assistant" else []
        if calls and not request.last_turn:
            observation = [{"role": "tool", "content": self._run_call(call, params, cookies)} for call in calls]
            if request.episode_id:
                with self._lock:
                    self._sessions[request.episode_id] = cookies
            return EnvResponse(reward=0.0, done=False, observation=observation)
        with self._lock:
            self._sessions.pop(request.episode_id, None)
        response = chat_to_response(
            _after_input(request.messages, params),
            tools=params.get("tools"),
            model=params.get("model") or "policy",
            response_id=f"resp_{request.episode_id or uuid.uuid4().hex[:12]}",
            parallel_tool_calls=params.get("parallel_tool_calls", True),
            tool_choice=params.get("tool_choice", "auto"),
        )
        verdict = _json_object(self._post("verify", {**request.record, "response": response}, cookies))
        self._count("verify_calls")
        if not isinstance(verdict.get("reward"), (int, float)):
            raise GymServerError(
                f"NeMo Gym resources server {self.url} answered POST /verify without a numeric reward: "
                f"{one_line(str(verdict))[:200]}"
            )
        if verdict.get("mask_sample"):
            self._count("masked")
        info = {key: verdict[key] for key in ("failure_kind", "failure_reason") if verdict.get(key) is not None}
        return EnvResponse(
            reward=float(verdict["reward"]),
            components=verdict_components(verdict, request.record),
            mask_sample=bool(verdict.get("mask_sample", False)),
            info=info,
        )

    def _run_call(self, call: ToolCall | str, params: dict[str, Any], cookies: dict[str, str]) -> str:
        """The observation for one call; `cookies` is updated from the tool's answer."""
        self._count("tool_calls")
        if isinstance(call, str):
            self._count("tool_errors")
            return call
        listed = [tool.get("name") for tool in params.get("tools") or [] if isinstance(tool, dict)]
        if not TOOL_NAME.fullmatch(call.name) or call.name in GYM_ROUTES or (listed and call.name not in listed):
            self._count("tool_errors")
            return f"error: unknown tool {call.name!r}; tools: {', '.join(map(str, listed)) or 'none'}"
        answer = self._post(call.name, call.arguments, cookies, tool=True)
        if answer.status_code >= 400:
            self._count("tool_errors")
        cookies.update(answer.cookies)
        return answer.text

    def _post(self, route: str, body: dict[str, Any], cookies: dict[str, str], tool: bool = False) -> httpx.Response:
        """POST `body` to /`route`, retried per the module doc; a tool's 4xx answers are returned, not raised."""
        headers = {"cookie": "; ".join(f"{name}={value}" for name, value in cookies.items())} if cookies else {}
        deadline = time.monotonic() + self.config.deadline_s
        cause, kind, retry_after, attempts = "", "gym_server", None, 0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                wait = retry_wait(attempt, self.config.backoff_s, retry_after, deadline)
                if wait is None:
                    cause += f" (no time left for another attempt within deadline_s={self.config.deadline_s:g})"
                    break
                time.sleep(wait)
            attempts, retry_after = attempts + 1, None
            try:
                response = send_within(self._client, "POST", f"/{route}", deadline, json=body, headers=headers)
            except httpx.TransportError as exc:  # refused, reset, timed out, disconnected, trickling past the deadline
                cause = f"{type(exc).__name__}: {one_line(exc) or 'no detail'}"
                kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "gym_server"
                continue
            if response.status_code < 400:
                return response
            cause = f"HTTP {response.status_code}: {one_line(response.text[:300]) or response.reason_phrase}"
            kind = "gym_server"
            if not retryable_status(response.status_code):
                if tool:  # the policy's call, refused by the tool (e.g. 422: arguments that fail its schema)
                    return response
                raise GymServerError(f"NeMo Gym resources server {self.url} rejected POST /{route}: {cause}")
            retry_after = retry_after_s(response)
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        raise GymServerUnavailable(
            f"NeMo Gym resources server {self.url} failed POST /{route} after {tries}: {cause}", kind
        )

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1


def check_resources_server(task: str, url: str, timeout_s: float = 5.0) -> None:
    """Refuse, at start-up, a Gym server of another kind at `env.gym.<task>.url`: a gymnasium-style one (Gym's
    blackjack, sokoban, tetris: `/reset` and `/step`, for Gym's gymnasium_agent) would answer the first
    `/seed_session` with a 404 only once the model has loaded. Its route list comes from FastAPI's
    `/openapi.json`; a server that does not answer, or lists no routes, is left to the calls themselves
    (which retry, then name it)."""
    try:
        paths = set(httpx.get(f"{url.rstrip('/')}/openapi.json", timeout=timeout_s).json().get("paths") or {})
    except (httpx.HTTPError, ValueError, AttributeError):
        return
    if {"/reset", "/step"} <= paths and "/verify" not in paths:
        raise ConfigError(
            f"env.gym.{task}.url={url} is a gymnasium-style NeMo Gym server (/reset, /step), which env.gym does not "
            "drive; env.gym takes resources servers (/seed_session, /verify); run it under Gym's gymnasium_agent "
            "and give that agent as agent.gym.<name>.url (rollout.driver=agent)"
        )


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        value = response.json()
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise GymServerError(
            f"{response.url} answered with something other than a JSON object: {one_line(response.text[:120])!r}"
        )
    return value


def _after_input(messages: list[dict[str, Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages after the row's input (and the system message the prompt may have put before it)."""
    prompt, _ = create_params_to_chat(params)
    for start in (0, 1):
        if messages[start : start + len(prompt)] == prompt and (start == 0 or messages[0]["role"] == "system"):
            return messages[start + len(prompt) :]
    raise DataError(
        "the conversation does not start with its Gym row's input messages; NeMo Gym tasks need prompts "
        "rendered from the row (data/prompts.py)"
    )
