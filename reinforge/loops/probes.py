"""Start-up probes: one cheap call to each server a run depends on and does not start itself, before the run
directory exists (loops/run_checks.py), so that a wrong address, token or key is one line at start-up rather than
a failure once the model has loaded, or worse a fault restarted as infrastructure.

Each probe answers within `PROBE_TIMEOUT_S`:

- a refused connection, an unknown host or no connection within the deadline: the URL is wrong or the server is
  not running (at start-up this is configuration; once the run is going the same failure is infrastructure,
  retried and masked);
- HTTP 401/403: the token or key is wrong; 404 (and the other 4xx but 408/429): the URL is not that server's;
- anything else (an answer, a 5xx, a slow answer): passes; the calls themselves retry and name it.

Probed: `env.remote.<task>` (GET /metrics with its token), `env.judge` in chat mode (a one-token chat completion
of its model, with its key: a wrong model name is a 404 too) and reward_model mode (POST /score of no
conversation), `env.gym.<task>` (POST /seed_session of the task's first record), `agent.gym.<name>` (GET
/openapi.json). Only the servers of the run's tasks; the environments a run serves itself (`agent.serve_envs`) and
the judge in local mode are not probed.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.data.prompts import Prompt
from reinforge.errors import ConfigError

PROBE_TIMEOUT_S = 5.0


def probe(setting: str, url: str, method: str = "GET", body: Any = None, token: str | None = None) -> None:
    """One call to `url`; a one-line ConfigError naming `setting` when the answer says the configuration is
    wrong (module docstring)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url, json=body, headers=headers, timeout=PROBE_TIMEOUT_S)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as exc:
        raise ConfigError(
            f"{setting}: {url} cannot be reached at start-up ({_cause(exc)}); start the server, or correct the URL"
        ) from None
    except httpx.HTTPError:  # a slow or broken answer: the calls retry it, and name it
        return
    status = response.status_code
    if status in (401, 403):
        raise ConfigError(
            f"{setting}: {url} refused the credentials (HTTP {status}: {_detail(response)}); check the token or key "
            "the setting names"
        )
    if 400 <= status < 500 and status not in (408, 429):
        raise ConfigError(
            f"{setting}: {url} answered HTTP {status} ({_detail(response)}) at start-up; is the URL the server's?"
        )


def probe_servers(config: RLRunConfig, tasks: set[str], prompts: list[Prompt]) -> None:
    """Probe every outside server the run's `tasks` (and agents) call, before the run directory exists."""
    env = config.env
    for task in sorted(tasks & set(env.remote)):
        remote = env.remote[task]
        token = os.environ.get(remote.token_env) if remote.token_env else None
        probe(f"env.remote.{task}.url (token: {remote.token_env or 'none'})", _join(remote.url, "metrics"), token=token)
    judged = "judge" in tasks or ("tool_use" in tasks and env.tool_use.answer_env == "judge")
    if judged and env.judge.mode != "local" and env.judge.url and "judge" not in {*env.remote, *env.custom, *env.gym}:
        key = os.environ.get(env.judge.api_key_env) if env.judge.api_key_env else None
        setting = f"env.judge.url (key: {env.judge.api_key_env or 'none'})"
        if env.judge.mode == "chat":  # one token: any OpenAI-compatible server has the route, and knows the model
            ping = {"model": env.judge.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
            probe(f"{setting}, env.judge.model={env.judge.model}", _join(env.judge.url, "chat/completions"), "POST",
                  ping, token=key)  # fmt: skip
        else:
            probe(setting, _join(env.judge.url, "score"), "POST", {"conversations": []}, token=key)
    for task in sorted(tasks & set(env.gym)):
        record = next((p.record for p in prompts if p.record.get("task", env.default_task) == task), None)
        if record is not None:  # a session of its first record: what the rollout's first call does
            probe(f"env.gym.{task}.url", _join(env.gym[task].url, "seed_session"), "POST", record)
    if config.rollout.driver == "agent":
        for name, gym in config.agent.gym.items():
            probe(f"agent.gym.{name}.url", _join(gym.url, "openapi.json"))


def _join(url: str, path: str) -> str:
    return f"{url.rstrip('/')}/{path}"


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[-1] if text else type(exc).__name__)[:160]


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().replace("\n", " ")[:120] or response.reason_phrase
    detail = body.get("detail") or body.get("error") if isinstance(body, dict) else body
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return str(detail).replace("\n", " ")[:120]
