"""What every reinforge HTTP server checks before a route runs, and how it words its errors.

Used by the environment servers (envs/http_server.py, envs/gym_server.py) and the OpenAI-compatible
endpoint (serving/):

    app.add_middleware(Guard, token=token, max_request_bytes=limit, open_paths=("/health",))

`Guard` answers 401 without the bearer token (when one is set; `open_paths` need none), 413 for a
body over `max_request_bytes` (also one sent without a Content-Length) and 415 for a POST whose
Content-Type is not `application/json`. Every error body is `{"detail": "<one line>"}`.
`check_bind_address` (reinforge/exposure.py) refuses to serve beyond loopback unless asked to.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


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
    return JSONResponse({"detail": detail}, status_code=status)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def describe_validation_error(exc: RequestValidationError) -> str:
    """FastAPI's validation error as one line naming the first bad field: `bad request: requests.0.record: Field required`."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return f"bad request: the body is not valid JSON ({reason} at character {first['loc'][-1]})"
    where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"bad request: {where}: {first['msg']}{more}"
