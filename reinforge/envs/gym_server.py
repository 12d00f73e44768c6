"""A reinforge environment served as a NeMo Gym resources server (`reinforge env serve --protocol gym`).

Gym's agents (e.g. `simple_agent`) and trainers that speak Gym (NeMo-RL) can then use math, code,
ifeval, tool_use or your own `module:Class` environment as they use Gym's own servers. The routes
(NeMo Gym 0.7.0's resources-server protocol, as `nemo_gym/base_resources_server.py` serves it):

    POST /seed_session       any JSON object (the row) -> {}        (the environments keep no session)
    POST /close_session      any JSON object -> {} (or {"resources_session_id"} echoed)
    POST /verify             a Gym verify request: the row (`responses_create_params` + its own fields,
                             e.g. `answer`) and `response` (a Responses object)
                             -> {**request, "reward", "mask_sample", "failure_kind": null,
                                 "failure_reason": null, each component as a field of its own,
                                 "reward_components" (when the components sum to the reward)}
    POST /aggregate_metrics  {"verify_responses": [...]} -> key_metrics {"mean/reward"}, as Gym's
    POST /<tool name>        one per tool of the environment (tool_use: /calculator, /python): the
                             tool's JSON arguments -> its text as a JSON value when the text parses
                             as JSON (the calculator's "42" is the number 42), else as a JSON string
    GET  /health             -> {"status": "ok"}   (the only route open without the token)

What /verify scores: the row's input messages, then `response.output` converted back to chat
messages (data/responses_format.py: function calls as `<tool_call>` blocks in the assistant's text,
their outputs as `tool` messages), as one EnvRequest whose record is the request without
`response`, marked `last_turn`. An output without an assistant message counts as an empty answer.
The environment's components are each a top-level field of the answer, as Gym's multi-reward servers
give theirs (NeMo-RL averages every numeric field into per-agent metrics; reinforge's agent rollouts
take the numeric fields the verifier added as components). They are also `reward_components` only
when they sum to `reward`: that is what the field means in Gym, and NeMo-RL checks it; tool_use's
counters (`num_tool_calls`, `tool_result_correct`) are not parts of its reward.

Errors and guards are those of the reinforge protocol (http_server.py, reinforge/network.py):
bearer token (401), body size (413), JSON content type (415); a malformed body is a 422 naming the
field (`bad request: response: Field required`), a record the environment cannot score a 422, a
tool's ValueError (or a missing argument) a 400, anything else from the environment a 500, a sample the
environment could not score for a failure of its own (`infra_failure`: its judge, verifier or sandbox) a 503,
which the caller retries, never a reward of 0; every error body is `{"detail": "<one line>"}`.
"""

from __future__ import annotations

import json
import logging
from statistics import mean
from typing import Any

from fastapi import Body, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from reinforge.data.responses_format import create_params_to_chat, hermes_messages, items_to_chat
from reinforge.envs.base import Environment, EnvRequest, Tool
from reinforge.errors import ConfigError, ReinforgeError
from reinforge.network import Guard, describe_validation_error, error_response, one_line

_log = logging.getLogger(__name__)
RESERVED_ROUTES = ("seed_session", "close_session", "verify", "aggregate_metrics", "health")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # Gym's request models allow the row's own fields


class CreateParams(_Open):
    input: str | list[dict[str, Any]]


class ResponseObject(_Open):
    output: list[dict[str, Any]]


class VerifyBody(_Open):
    responses_create_params: CreateParams
    response: ResponseObject


class AggregateBody(_Open):
    verify_responses: list[dict[str, Any]]


def build_gym_app(env: Environment, token: str | None, max_request_bytes: int) -> FastAPI:
    """The NeMo Gym resources server for `env`; `token`: the bearer token every route but /health needs."""
    app = FastAPI(title="reinforge environment (NeMo Gym protocol)", docs_url=None, redoc_url=None, openapi_url=None)
    tools: dict[str, Tool] = getattr(env, "tools", {})
    clashing = [name for name in tools if name in RESERVED_ROUTES]
    if clashing:
        raise ConfigError(f"tool {clashing[0]!r} would shadow the Gym route /{clashing[0]}; rename the tool")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, describe_validation_error(exc))

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/seed_session")
    def seed_session(body: dict[str, Any] = Body()) -> dict[str, Any]:
        return {}

    @app.post("/close_session")
    def close_session(body: dict[str, Any] = Body()) -> dict[str, Any]:
        return {"resources_session_id": body["resources_session_id"]} if "resources_session_id" in body else {}

    @app.post("/verify")
    async def verify(body: VerifyBody) -> dict[str, Any]:
        row = body.model_dump()
        try:
            request = _env_request(row)
        except ReinforgeError as exc:
            raise HTTPException(422, one_line(exc))
        try:
            (response,) = await run_in_threadpool(env.step, [request])
        except ReinforgeError as exc:
            raise HTTPException(422, one_line(exc))
        except Exception as exc:  # the server stays up; the caller sees the cause
            _log.exception("environment %s failed on /verify", type(env).__name__)
            raise HTTPException(500, f"environment {type(env).__name__} failed: {one_line(exc)}")
        if response.infra_failure:  # no verdict (its judge, verifier or sandbox failed): Gym has no field for that
            cause = one_line(response.info.get("infra_error") or response.infra_failure)
            raise HTTPException(503, f"environment {type(env).__name__} could not score this: {cause}")
        answer = {
            **row,
            **response.components,
            "reward": response.reward,
            "mask_sample": response.mask_sample,
            "failure_kind": None,
            "failure_reason": None,
        }
        if response.components and abs(sum(response.components.values()) - response.reward) <= 1e-5 * max(
            1.0, abs(response.reward)
        ):
            answer["reward_components"] = response.components
        return answer

    @app.post("/aggregate_metrics")
    def aggregate_metrics(body: AggregateBody) -> dict[str, Any]:
        return _aggregate(body.verify_responses)

    for tool in tools.values():
        app.post(f"/{tool.name}", name=tool.name)(_tool_route(tool))

    app.add_middleware(Guard, token=token, max_request_bytes=max_request_bytes, open_paths=("/health",))
    return app


def _env_request(row: dict[str, Any]) -> EnvRequest:
    """The conversation of a verify request as the environment sees it (see the module doc)."""
    prompt, _ = create_params_to_chat(row["responses_create_params"])
    messages = hermes_messages(prompt + items_to_chat(row["response"]["output"]))
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    record = {key: value for key, value in row.items() if key != "response"}
    return EnvRequest(messages=messages, record=record, last_turn=True)


def _tool_route(tool: Tool):
    async def call_tool(arguments: dict[str, Any] = Body()) -> Any:
        try:
            text = await run_in_threadpool(tool.run, arguments)
        except (ValueError, KeyError, TypeError) as exc:
            raise HTTPException(400, f"tool {tool.name!r} rejected its arguments: {one_line(exc)}")
        except Exception as exc:
            _log.exception("tool %r failed", tool.name)
            raise HTTPException(500, f"tool {tool.name!r} failed: {one_line(exc)}")
        try:
            return json.loads(text)
        except ValueError:
            return text

    return call_tool


def _aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean reward over all rows (key_metrics, as Gym's), the mean of each numeric top-level field
    (agent_metrics), and the mean reward of each task (`_ng_task_index`)."""
    numeric = sorted(
        {
            key
            for row in rows
            for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not key.startswith("_ng_")
        }
    )
    agent_metrics = {f"mean/{key}": mean(row[key] for row in rows if key in row) for key in numeric}
    by_task: dict[Any, list[float]] = {}
    for row in rows:
        if "reward" in row:
            by_task.setdefault(row.get("_ng_task_index"), []).append(row["reward"])
    groups = [
        {"_ng_task_index": task, "mean/reward": mean(rewards)} for task, rewards in by_task.items() if task is not None
    ]
    key_metrics = {"mean/reward": agent_metrics["mean/reward"]} if "mean/reward" in agent_metrics else {}
    return {"group_level_metrics": groups, "agent_metrics": agent_metrics, "key_metrics": key_metrics}
