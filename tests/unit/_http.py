"""A real HTTP server on 127.0.0.1 for tests of the clients that call one: a handler class serves it on a thread."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free port of 127.0.0.1 until the block ends; its base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that does not write a line to stderr for each request."""

    def log_message(self, *args):
        pass


def served(handler: type[BaseHTTPRequestHandler], name: str):
    """A module-scoped fixture named `name` (assign it to that name in the test module): `handler` served by
    `http_server` for the module's tests; its base URL."""

    @pytest.fixture(scope="module", name=name)
    def url():
        with http_server(handler) as base:
            yield base

    return url
