"""What every reinforge HTTP server shares: how it is exposed, what it checks before a route runs, how it
words its errors, and the uvicorn thread it may run on.

Used by the environment servers (envs/http_server.py, envs/gym_server.py), the OpenAI-compatible endpoint
(serving/), their command lines, and the trainers' process groups (`free_port`).

- Exposure: `add_bind_arguments` gives a server command --host, --port, --allow-remote and --token-env;
  `check_bind_address` refuses to serve beyond loopback unless asked to, and then without a token;
  `token_from_env` reads the token.
- Guard: `app.add_middleware(Guard, token=token, max_request_bytes=limit, open_paths=("/health",))`
  answers 401 without the bearer token (when one is set; `open_paths` need none), 413 for a body over
  `max_request_bytes` (also one sent without a Content-Length) and 415 for a POST whose Content-Type is
  not `application/json`. Every error body is `{"detail": "<one line>"}`.
- `ThreadedServer`: an ASGI app served by uvicorn on a thread of this process (the policy endpoint inside
  a run, the environments a run serves for its agents).

No web framework is imported at module level, so that `reinforge --help` stays instant and the GPU
benchmarks can take `free_port` on machines without one.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from reinforge.errors import ConfigError

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

STARTUP_TIMEOUT_S = 30.0


def free_port(host: str = "") -> int:
    """A TCP port that was free on `host` ("" = every interface) a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# Exposure


def add_bind_arguments(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    """--host, --port (required when `default_port` is None), --allow-remote and --token-env: how every
    reinforge server command is exposed."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    if default_port is None:
        parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    else:
        parser.add_argument(
            "--port", type=int, default=default_port, help=f"TCP port (default: {default_port}; 0 picks a free one)"
        )
    parser.add_argument("--allow-remote", action="store_true", help="allow a --host other than loopback")
    parser.add_argument(
        "--token-env",
        metavar="VAR",
        help="name of the environment variable holding the bearer token clients must send (the token itself "
        "never goes on the command line, where `ps` would show it)",
    )


def token_from_env(variable: str | None, setting: str) -> str | None:
    """The bearer token held by environment variable `variable` (None when no variable is named); `setting`
    names where the variable was given, for the error when it is unset or empty."""
    if not variable:
        return None
    token = os.environ.get(variable)
    if not token:
        raise ConfigError(f"{setting} {variable}: that environment variable is unset or empty; export the token in it")
    return token


def check_bind_address(host: str, allow_remote: bool, token: str | None) -> None:
    """Refuse a non-loopback `host` unless `allow_remote`, and then without a `token`: a server other machines
    reach without one serves anyone who can reach it."""
    if not allow_remote and not is_loopback(host):
        raise ConfigError(
            f"--host {host} is not a loopback address; pass --allow-remote to serve other machines "
            "(and set a token with --token-env)"
        )
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"--allow-remote --host {host} without a token: anyone who can reach it could call it; set one with "
            "--token-env VAR (VAR: an environment variable holding the token)"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Guard and error wording


class Guard:
    """ASGI middleware: token, body size and content type, checked before any route sees a request."""

    def __init__(
        self, app: Any, token: str | None, max_request_bytes: int, open_paths: tuple[str, ...] = ("/health",)
    ) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token else None
        self.max_request_bytes = max_request_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._expected is not None and scope["path"] not in self.open_paths:
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
            await _send_error(
                scope, send, 415, f"request body must be JSON (Content-Type: application/json), got {shown}"
            )
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
    response = error_response(status, detail)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    await response(scope, None, send)


def error_response(status: int, detail: str) -> JSONResponse:
    from fastapi.responses import JSONResponse

    return JSONResponse({"detail": detail}, status_code=status)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def describe_validation_error(exc: RequestValidationError) -> str:
    """FastAPI's validation error as one line naming the first bad field:
    `bad request: requests.0.record: Field required`."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return f"bad request: the body is not valid JSON ({reason} at character {first['loc'][-1]})"
    where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"bad request: {where}: {first['msg']}{more}"


# A server on a thread


class ThreadedServer:
    """`app` (any ASGI application) served by uvicorn on a daemon thread of this process; port 0 takes a free one."""

    def __init__(self, app: Any, host: str, port: int, name: str):
        self.app, self.host, self.name = app, host, name
        self.port = port or free_port(host)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> ThreadedServer:
        import uvicorn

        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", access_log=False, timeout_keep_alive=30
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"reinforge-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(
                    f"the {self.name} could not start on {self.host}:{self.port} (is the port in use?); "
                    "choose another port, or 0 for any free one"
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
