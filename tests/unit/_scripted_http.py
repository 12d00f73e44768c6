"""A real HTTP server on 127.0.0.1, in a thread, whose answers a test scripts: a status, headers, a body, and how
slowly to send it (a byte at a time, to trickle). For the outside-failure tests: a server that answers 503 for a
while and then recovers, trickles, answers 429 with Retry-After, or answers something other than JSON."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # JSON-encoded unless bytes
    headers: tuple[tuple[str, str], ...] = ()
    trickle_s: float = 0.0  # seconds between bytes of the body; 0: all at once


Script = Callable[[str, str, Any], Reply]  # (method, path, the request's JSON or None) -> the reply


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self._answer()

    def _answer(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        reply = self.server.script(self.command, self.path, json.loads(raw) if raw else None)
        body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
        self.send_response(reply.status)
        for name, value in reply.headers:
            self.send_header(name, value)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        try:
            if not reply.trickle_s:
                self.wfile.write(body)
                return
            for index in range(len(body)):
                self.wfile.write(body[index : index + 1])
                self.wfile.flush()
                time.sleep(reply.trickle_s)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: what the test wants to see
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up mid-answer (the point of these tests) is no error of the server's


@contextlib.contextmanager
def scripted_server(script: Script) -> Iterator[str]:
    """Serve `script` on a free port of 127.0.0.1; yields the base URL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.script = script
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def down_until(seconds: float, then: Script, status: int = 503) -> Script:
    """A script that answers `status` to every request for `seconds` from its first request, then as `then`."""
    started: list[float] = []

    def script(method: str, path: str, body: Any) -> Reply:
        started.append(time.monotonic()) if not started else None
        if time.monotonic() - started[0] < seconds:
            return Reply(status, {"error": "overloaded"})
        return then(method, path, body)

    return script
