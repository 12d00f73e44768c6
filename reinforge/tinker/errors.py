"""The Tinker server's errors: each becomes the HTTP status or failed future that the `tinker` SDK turns into its own
exception (see wire.py's notes), with a one-line message that names the problem and how to fix it."""

from __future__ import annotations


class TinkerRequestError(ValueError):
    """One line for the user: what is wrong and how to fix it; the server answers it as a 400 the SDK raises
    (`tinker.BadRequestError`), or, for a request already queued, as a failed future (`tinker.RequestFailedError`)."""

    status = 400


class UnknownResource(TinkerRequestError):
    """A model id, session, sampling session, future or checkpoint this server does not hold (HTTP 404:
    `tinker.NotFoundError`)."""

    status = 404


class SessionClosed(TinkerRequestError):
    """A session that finished or whose heartbeat lapsed (HTTP 410: the SDK stops its heartbeat)."""

    status = 410


class Unauthorized(TinkerRequestError):
    """A missing or wrong API key (HTTP 401: `tinker.AuthenticationError`)."""

    status = 401


class QueueFull(TinkerRequestError):
    """The device's queue holds `tinker.max_queued_requests` already (HTTP 429: the SDK backs off and retries)."""

    status = 429
