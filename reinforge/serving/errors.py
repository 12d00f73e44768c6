"""Why the endpoint refuses or fails a request, in the server's words; serving/app.py maps each to an HTTP
status and OpenAI's error body (`InvalidRequest` 400, `NotInRollout` 503, `EpisodeOver` 409,
`GenerationFailed` 500, `GenerationTimedOut` 504, `QueueFull` 429 with Retry-After)."""

from __future__ import annotations


class EndpointError(Exception):
    """A request the endpoint does not answer with a completion; `message` is one line for the client."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class InvalidRequest(EndpointError):
    """A request that cannot be served as asked; `param` names the field at fault."""


class NotInRollout(EndpointError):
    """A call to a run's endpoint between rollouts, while the trainer owns the engine."""


class EpisodeOver(EndpointError):
    """A call under the URL of an episode that ended or timed out: it would no longer be recorded."""


class GenerationFailed(EndpointError):
    """The engine raised while generating an admitted request."""


class GenerationTimedOut(EndpointError):
    """An admitted request not answered within `request_timeout_s`."""


class QueueFull(EndpointError):
    """`max_queued_requests` are already waiting for the engine; the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s
