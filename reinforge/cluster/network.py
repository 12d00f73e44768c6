"""Network helpers that need no Ray (the GPU benchmark and tests import them on machines without it)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port that was free on `host` ("" = every interface) a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
