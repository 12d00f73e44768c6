"""`env.gym.<task>`: a NeMo Gym resources server that scores (and holds the tools of) a task when
reinforge drives the model (envs/gym.py). Apart from the client so that the config schema imports no HTTP code."""

from __future__ import annotations

from pydantic import model_validator

from reinforge.config.section import Section


class GymResourcesConfig(Section):
    url: str = ""
    """Base URL of the resources server, e.g. http://127.0.0.1:18001 (its /seed_session, tool routes and /verify)."""
    timeout_s: float = 60.0
    """Time limit for connecting, sending, and each wait for the server's answer to one call."""
    max_retries: int = 8
    """Retries after a connection error, a timeout, a 5xx, 408 or 429 answer (tool calls included; the default rides
    out about a minute and a half of outage); then the episode is an infrastructure failure, run again and then
    masked (docs/environments.md)."""
    backoff_s: float = 0.5
    """Wait before the first retry; each further retry waits twice as long, at most 30 s (a server's Retry-After
    replaces it)."""
    deadline_s: float = 300.0
    """The most one call may take, its retries and their waits included: a server that trickles its answer or keeps
    failing is an infrastructure failure by then."""
    max_concurrency: int = 64
    """Most calls in flight to the server at once."""

    @model_validator(mode="after")
    def _check(self) -> "GymResourcesConfig":
        checks = [
            (self.url.startswith(("http://", "https://")), f"url={self.url!r} must start with http:// or https://"),
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (self.deadline_s > 0, "deadline_s must be > 0"),
            (self.max_retries >= 0 and self.backoff_s >= 0, "max_retries and backoff_s must be >= 0"),
            (self.max_concurrency >= 1, "max_concurrency must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"NeMo Gym resources server {message}")
        return self
