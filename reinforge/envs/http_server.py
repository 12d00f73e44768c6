"""Serving an environment over HTTP, like NeMo Gym's resource servers.

The verifier runs in its own process (or on another machine) and the trainer reaches it with
`RemoteEnvironment` (http_client.py). JSON only, in and out; nothing is ever unpickled.

    POST /verify         {"requests": [{"messages": [...], "record": {...}}, ...]}
                         (each may also carry "episode_id" and "last_turn")
                         -> {"responses": [{"reward", "components", "done", "observation", "info", "mask_sample"}, ...]}
    GET  /health         -> {"status": "ok"}   (the only route open without the token)
    GET  /metrics        -> {"metrics": env.metrics()}   (counters since the last call, then reset)
    GET  /tools          -> {"tools": [{"name", "description", "parameters"}, ...]}
    POST /tools/{name}   {"arguments": {...}} -> {"observation": "..."}

Guards, checked before a route runs: a bearer token when one is set (401), a body size limit
(413, also for bodies sent without a Content-Length) and `Content-Type: application/json` on every
POST (415). A malformed body is 422, a `ReinforgeError` from the environment (a record without the
field it needs) is 422, a tool's `ValueError` (bad arguments) is 400, an unknown tool is 404, any other
exception from the environment is 500; every error body is `{"detail": "<one line>"}`.

`env.step` runs in Starlette's threadpool (40 threads), so a slow batch does not block other
requests or `/health`. The environment decides how much of that is parallel: `MathEnv` serialises
its math-verify calls behind one lock.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import sys
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from reinforge.envs.base import Environment, EnvRequest
from reinforge.errors import ConfigError, ReinforgeError

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
        return _error(422, _describe_validation_error(exc))

    @app.get("/health")
    def health() -> HealthResponse:
        return HealthResponse(status="ok")

    @app.post("/verify")
    async def verify(body: VerifyRequest) -> VerifyResponse:
        requests = [EnvRequest(messages=item.messages, record=item.record, episode_id=item.episode_id, last_turn=item.last_turn)
                    for item in body.requests]
        try:
            responses = await run_in_threadpool(env.step, requests)
        except ReinforgeError as exc:
            raise HTTPException(422, str(exc))
        except Exception as exc:  # the server stays up; the client sees the cause and may retry
            _log.exception("environment %s failed on a batch of %d", type(env).__name__, len(requests))
            raise HTTPException(500, f"environment {type(env).__name__} failed: {_one_line(exc)}")
        results = [
            VerifyResult(
                reward=r.reward, components=r.components, done=r.done, observation=r.observation, info=r.info,
                mask_sample=r.mask_sample,
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
            raise HTTPException(400, f"tool {name!r} rejected its arguments: {_one_line(exc)}")
        except Exception as exc:
            _log.exception("tool %r failed", name)
            raise HTTPException(500, f"tool {name!r} failed: {_one_line(exc)}")
        return ToolResult(observation=observation)

    app.add_middleware(_Guard, token=token, max_request_bytes=max_request_bytes)
    return app


def serve(
    env: Environment,
    *,
    port: int,
    host: str = "127.0.0.1",
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allow_remote: bool = False,
) -> None:
    """Serve `env` until interrupted (Ctrl-C or SIGTERM), then close it.

    A host other than loopback needs `allow_remote=True`: the server runs whatever verifier code
    the environment holds, so exposing it to a network is a choice to make on purpose.
    """
    import uvicorn

    try:
        check_bind_address(host, allow_remote)
        if not _is_loopback(host):
            exposure = "with a bearer token" if token else "WITHOUT a token: anyone who can reach it can call it"
            print(f"reinforge: warning: serving on {host}:{port}, reachable from other machines, {exposure}", file=sys.stderr)
        app = build_app(env, token, max_request_bytes)
        access = "token required" if token else "no token"
        print(f"serving {type(env).__name__} at http://{host}:{port} ({access}); Ctrl-C stops", file=sys.stderr, flush=True)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        env.close()


def check_bind_address(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback `host` unless `allow_remote`."""
    if not allow_remote and not _is_loopback(host):
        raise ConfigError(
            f"--host {host} is not a loopback address; pass --allow-remote to serve other machines "
            "(and set a token with --token-env)"
        )


class _Guard:
    """ASGI middleware: token, body size and content type, checked before any route sees a request."""

    def __init__(self, app: Any, token: str | None, max_request_bytes: int) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._expected is not None and scope["path"] != "/health":
            # A constant-time comparison, so response timing does not leak the token.
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
                await _send_error(scope, send, 401, "missing or wrong bearer token (Authorization: Bearer <token>)")
                return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type != b"application/json":
            shown = content_type.decode("latin-1") or "none"
            await _send_error(scope, send, 415, f"request body must be JSON (Content-Type: application/json), got {shown}")
            return
        too_large = f"request body exceeds the server's limit of {self.max_request_bytes} bytes; send smaller batches"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            await _send_error(scope, send, 413, too_large)
            return
        # Read the whole body here (bounded), so that a chunked upload cannot pass the limit either.
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                await _send_error(scope, send, 413, too_large)
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def _send_error(scope: dict, send: Any, status: int, detail: str) -> None:
    response = _error(status, detail)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    await response(scope, None, send)


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _describe_validation_error(exc: RequestValidationError) -> str:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return f"bad request: the body is not valid JSON ({reason} at character {first['loc'][-1]})"
    where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"bad request: {where}: {first['msg']}{more}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
