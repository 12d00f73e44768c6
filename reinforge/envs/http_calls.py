"""HTTP calls to outside components under a total deadline (env servers, judges, Gym servers).

httpx's timeouts bound each phase of a request (connecting, sending, each wait between received bytes), so a
server that trickles its answer a byte a second never times out. `send_within` reads the whole answer by a
deadline: each phase waits at most the client's own timeout and never past the deadline, and a body still arriving
at the deadline is a `ReadTimeout` (a `TransportError`, so every caller's retry treats it as the timeout it is). A
call therefore ends within its deadline plus at most one wait between bytes.

`retry_wait` is the shared retry schedule: the server's `Retry-After` when it sent one (HTTP 429 and 503), else
exponential backoff up to `MAX_BACKOFF_S` a wait; never a wait that would end past the call's deadline.
"""

from __future__ import annotations

import email.utils
import time
from typing import Any

import httpx

MAX_BACKOFF_S = 30.0
"""The longest wait between two attempts that the backoff alone asks (a server's Retry-After may ask more): past a
minute of outage, retrying every half minute rides out the rest without waiting minutes after the server is back."""

RETRYABLE_STATUS = frozenset({408, 429})
"""4xx answers that say "not now" rather than "not this request": retried like a 5xx."""

_DROPPED_HEADERS = ("content-encoding", "content-length", "transfer-encoding")  # the body below is decoded already


def retryable_status(status: int) -> bool:
    """Whether an HTTP status is the server's transient failure (5xx, 408, 429), worth asking again."""
    return status >= 500 or status in RETRYABLE_STATUS


def send_within(client: httpx.Client, method: str, url: str, deadline: float, **kwargs: Any) -> httpx.Response:
    """The whole answer to one request, read by `deadline` (a `time.monotonic()` value); see the module doc."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise httpx.ReadTimeout("no time left before the call's deadline")
    base = client.timeout
    timeout = httpx.Timeout(
        connect=_capped(base.connect, remaining),
        read=_capped(base.read, remaining),
        write=_capped(base.write, remaining),
        pool=_capped(base.pool, remaining),
    )
    request = client.build_request(method, url, timeout=timeout, **kwargs)
    response = client.send(request, stream=True)
    try:
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(
                    f"the answer was still arriving at the call's deadline ({len(body)} bytes read): "
                    "a server sending too slowly",
                    request=request,
                )
    finally:
        response.close()
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _DROPPED_HEADERS]
    return httpx.Response(response.status_code, headers=headers, content=bytes(body), request=request)


def retry_after_s(response: httpx.Response) -> float | None:
    """The wait a server asked for in `Retry-After` (seconds, or an HTTP date), None if it asked none."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def retry_wait(retry: int, backoff_s: float, retry_after: float | None, deadline: float) -> float | None:
    """Seconds to wait before retry number `retry` (1, 2, ...): the server's `retry_after` when it gave one, else
    `backoff_s * 2**(retry - 1)` up to `MAX_BACKOFF_S`; None when that wait would end past `deadline` (no time for
    another attempt)."""
    wait = retry_after if retry_after is not None else min(backoff_s * 2 ** (retry - 1), MAX_BACKOFF_S)
    return wait if time.monotonic() + wait < deadline else None


def one_line(value: BaseException | str) -> str:
    """An exception or a server's text on one line; an exception without a message gives its class name."""
    text = " ".join(str(value).split())
    return text or (type(value).__name__ if isinstance(value, BaseException) else "")


def _capped(limit: float | None, remaining: float) -> float:
    return remaining if limit is None else min(limit, remaining)
