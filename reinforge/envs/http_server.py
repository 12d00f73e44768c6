"""Serving an environment over HTTP, like NeMo Gym's resource servers.

The verifier runs in its own process (or on another machine) and the trainer reaches it with
`RemoteEnvironment` (http_client.py). JSON only, in and out; nothing is ever unpickled.

    POST /verify         {"requests": [{"messages": [...], "record": {...}}, ...]}
                         (each may also carry "episode_id" and "last_turn")
                         -> {"responses": [{"reward", "components", "done", "observation", "info", "mask_sample",
                             "infra_failure"}, ...]}
    GET  /health         -> {"status": "ok"}   (the only route open without the token)
    GET  /metrics        -> {"metrics": env.metrics()}   (counters since the last call, then reset)
    GET  /tools          -> {"tools": [{"name", "description", "parameters"}, ...]}
    POST /tools/{name}   {"arguments": {...}} -> {"observation": "..."}

Guards (`Guard`, reinforge/network.py), checked before a route runs: a bearer token when one is set (401),
a body size limit (413, also for bodies sent without a Content-Length) and `Content-Type:
application/json` on every POST (415). A malformed body is 422, a `ReinforgeError` from the environment (a record
without the field it needs) is 422, a tool's `ValueError` (bad arguments) is 400, an unknown tool is 404, any other
exception from the environment is 500; every error body is `{"detail": "<one line>"}`.

`env.step` runs in Starlette's threadpool (40 threads), so a slow batch does not block other
requests or `/health`. The environment decides how much of that is parallel: `MathEnv` serialises
its math-verify calls behind one lock.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from reinforge.envs.base import Environment, EnvRequest
from reinforge.errors import ReinforgeError
from reinforge.network import (
    Guard,
    check_bind_address,
    describe_validation_error,
    error_response,
    is_loopback,
    one_line,
)

_log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 64 << 20  # 64 MiB: a batch of thousands of long trajectories


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VerifyItem(_Body):
    messages: list[dict[str, str]] = Field(min_length=1)
    """The conversation; the last message is the policy's answer."""
    record: dict[str, Any]
    """The dataset record: whatever fields the environment needs."""
    episode_id: str = ""
    """The trajectory's id, the same on each of its turns."""
    last_turn: bool = False
    """The rollout stops after this turn whatever the answer."""


class VerifyRequest(_Body):
    requests: list[VerifyItem]


class VerifyResult(_Body):
    reward: float
    components: dict[str, float]
    done: bool
    observation: list[dict[str, str]] | None
    info: dict[str, Any]
    mask_sample: bool = False
    infra_failure: str | None = None


class VerifyResponse(_Body):
    responses: list[VerifyResult]


class ToolSpec(_Body):
    name: str
    description: str
    parameters: dict[str, Any]


class ToolsResponse(_Body):
    tools: list[ToolSpec]


class ToolCall(_Body):
    arguments: dict[str, Any]


class ToolResult(_Body):
    observation: str


class MetricsResponse(_Body):
    metrics: dict[str, float]


class HealthResponse(_Body):
    status: str


def build_app(env: Environment, token: str | None, max_request_bytes: int) -> FastAPI:
    """The HTTP app serving `env`; `token`: the bearer token every route but /health needs."""
    app = FastAPI(title="reinforge environment", docs_url=None, redoc_url=None, openapi_url=None)
    tools = getattr(env, "tools", {})

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, describe_validation_error(exc))

    @app.get("/health")
    def health() -> HealthResponse:
        return HealthResponse(status="ok")

    @app.post("/verify")
    async def verify(body: VerifyRequest) -> VerifyResponse:
        requests = [
            EnvRequest(messages=item.messages, record=item.record, episode_id=item.episode_id, last_turn=item.last_turn)
            for item in body.requests
        ]
        try:
            responses = await run_in_threadpool(env.step, requests)
        except ReinforgeError as exc:
            raise HTTPException(422, str(exc))
        except Exception as exc:  # the server stays up; the client sees the cause and may retry
            _log.exception("environment %s failed on a batch of %d", type(env).__name__, len(requests))
            raise HTTPException(500, f"environment {type(env).__name__} failed: {one_line(exc)}")
        results = [
            VerifyResult(
                reward=r.reward,
                components=r.components,
                done=r.done,
                observation=r.observation,
                info=r.info,
                mask_sample=r.mask_sample,
                infra_failure=r.infra_failure,
            )
            for r in responses
        ]
        return VerifyResponse(responses=results)

    @app.get("/metrics")
    async def metrics() -> MetricsResponse:
        return MetricsResponse(metrics=await run_in_threadpool(env.metrics))

    @app.get("/tools")
    def list_tools() -> ToolsResponse:
        specs = [ToolSpec(name=t.name, description=t.description, parameters=t.parameters) for t in tools.values()]
        return ToolsResponse(tools=specs)

    @app.post("/tools/{name}")
    async def call_tool(name: str, body: ToolCall) -> ToolResult:
        if name not in tools:
            raise HTTPException(404, f"no tool {name!r}; this environment has: {', '.join(tools) or 'no tools'}")
        try:
            observation = await run_in_threadpool(tools[name].run, body.arguments)
        except ValueError as exc:
            raise HTTPException(400, f"tool {name!r} rejected its arguments: {one_line(exc)}")
        except Exception as exc:
            _log.exception("tool %r failed", name)
            raise HTTPException(500, f"tool {name!r} failed: {one_line(exc)}")
        return ToolResult(observation=observation)

    app.add_middleware(Guard, token=token, max_request_bytes=max_request_bytes, open_paths=("/health",))
    return app


def serve(
    env: Environment,
    *,
    port: int,
    host: str = "127.0.0.1",
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allow_remote: bool = False,
    build: Callable[[Environment, str | None, int], FastAPI] = build_app,
) -> None:
    """Serve `env` until interrupted (Ctrl-C or SIGTERM), then close it; `build` makes the app (this
    module's protocol, or gym_server.build_gym_app for NeMo Gym's).

    A host other than loopback needs `allow_remote=True`: the server runs whatever verifier code
    the environment holds, so exposing it to a network is a choice to make on purpose.
    """
    import uvicorn

    try:
        check_bind_address(host, allow_remote, token)
        if not is_loopback(host):
            print(f"reinforge: serving on {host}:{port}, beyond this machine (token required)", file=sys.stderr)
        app = build(env, token, max_request_bytes)
        access = "token required" if token else "no token"
        print(
            f"serving {type(env).__name__} at http://{host}:{port} ({access}); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        env.close()
