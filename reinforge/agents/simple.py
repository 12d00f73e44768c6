"""A simple tool-calling agent in Python, the loop of NeMo Gym's `simple_agent`, over any NeMo Gym
resources server: `agent.python.simple=reinforge.agents.simple:run`.

For one row (a Gym row: `responses_create_params` with `input` and `tools`, plus the verifier's
fields): seed a session on the resources server (its cookie is kept for every later call), then loop:
ask the policy through the `openai` client, run each tool call on the server's `POST /<tool>` route
and give the raw answer back as the tool message, until a turn calls no tool, is cut by length, or
`MAX_STEPS` turns; then `POST /verify` with the whole episode as a Responses object, and return
Gym's verdict (reward, reward_components, mask_sample).

Each assistant message goes back into the conversation as the endpoint sent it (`model_dump` keeps
its token fields), so the endpoint splices each turn onto the exact tokens of the one before.

Each episode has HTTP clients of its own (its own connections, and cookie jar: its resources-server
session), all made with one SSL context (`_SSL`): a client that loads the CA bundle itself costs ~25 ms
of CPU, seconds per rollout at 64 concurrent episodes; with the shared context, under 1 ms.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx
from openai import OpenAI

from reinforge.data.responses_format import chat_to_response, create_params_to_chat

MAX_STEPS = 8
TIMEOUT_S = 300.0
_SSL = ssl.create_default_context()


def run(
    base_url: str,
    record: dict[str, Any],
    *,
    model: str,
    api_key: str,
    sampling: dict[str, Any],
    servers: dict[str, str],
) -> dict[str, Any]:
    params = record.get("responses_create_params") or {"input": [{"role": "user", "content": record["prompt"]}]}
    messages, tools = create_params_to_chat(params)
    with (
        httpx.Client(verify=_SSL, timeout=TIMEOUT_S) as http,
        httpx.Client(base_url=resources_url(record, servers), verify=_SSL, timeout=TIMEOUT_S) as resources,
    ):
        policy = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)
        resources.post("/seed_session", json=record).raise_for_status()  # keeps the session cookie
        return episode(policy, resources, record, params, messages, tools, model, sampling)


def episode(
    policy: OpenAI,
    resources: httpx.Client,
    record: dict[str, Any],
    params: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    model: str,
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """The turns of one episode, then Gym's verdict on them."""
    prompt_length = len(messages)
    for _ in range(MAX_STEPS):
        completion = policy.chat.completions.create(model=model, messages=messages, tools=tools, **sampling)
        choice = completion.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls or choice.finish_reason == "length":
            break
        for call in choice.message.tool_calls:
            answer = resources.post(
                f"/{call.function.name}",
                content=call.function.arguments or "{}",
                headers={"content-type": "application/json"},
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer.text})
    response = chat_to_response(
        messages[prompt_length:], tools=params.get("tools"), model=model, response_id=completion.id
    )
    verdict = resources.post("/verify", json={**record, "response": response})
    verdict.raise_for_status()
    return verdict.json()


def resources_url(record: dict[str, Any], servers: dict[str, str]) -> str:
    """The resources server of the row: `record["resources_server"]` names one of `servers`, else the only one."""
    name = record.get("resources_server")
    if name is None and len(servers) == 1:
        return next(iter(servers.values()))
    if name not in servers:
        raise ValueError(
            f"no resources server {name!r} among agent.servers / agent.serve_envs ({', '.join(servers) or 'none'}); "
            "give each record a resources_server field"
        )
    return servers[name]
