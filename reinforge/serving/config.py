"""The endpoint's settings: `reinforge serve`'s options, and `agent.endpoint` in a GRPO run."""

from __future__ import annotations

from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.network import is_loopback

_NO_TOKEN = (
    "host={} with allow_remote needs a token: set token_env to the name of an environment variable holding "
    "one (an endpoint other machines reach without a token lets anyone generate with the policy)"
)


class ServingConfig(Section):
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs `allow_remote` and a token (`token_env`)."""
    port: int = 0
    """TCP port; 0 picks a free one when the endpoint starts (its URL is printed and written to
    RUN_DIR/endpoint.json)."""
    allow_remote: bool = False
    """Allow a `host` other than loopback: the endpoint then serves other machines, so it needs a token
    (`token_env`): without one the config is refused."""
    token_env: str = ""
    """Name of the environment variable holding the bearer token clients must send; empty: no token."""
    model_name: str = "policy"
    """The model id the endpoint reports (`GET /v1/models`) and accepts in requests' `model` (any value is accepted)."""
    max_request_bytes: int = 16 << 20
    """Largest request body accepted; larger ones get HTTP 413."""
    max_batch_size: int = 256
    """Most requests the endpoint hands the engine in one call; more wait for the next call."""
    max_queued_requests: int = 1024
    """Most requests waiting for the engine (admitted, not yet in an engine call); one more is answered with HTTP
    429 and a Retry-After header (seconds) instead of growing the queue, and so the endpoint's memory, without
    bound. A run's agents send at most `agent.max_concurrency` at once, 256 by default."""
    batch_wait_s: float = 0.2
    """How long the endpoint waits, after the last request arrived, for more to join the engine call
    (at most 10 x this after the first; not at all when every agent of the rollout is already waiting).
    Training wants full batches more than low latency: 64 agents starting at once arrive over some
    100 ms on a 2-core machine (docs/benchmarks.md). `reinforge serve` defaults to 0.02."""
    request_timeout_s: float = 600.0
    """The longest a request waits for its completion (queued, then generated); then it is answered with HTTP 504,
    and a run's rollout stops waiting for the engine to answer the requests in flight (a `HangError`)."""
    max_tokens: int = 256
    """`reinforge serve`: completion length when a request gives no `max_tokens` (in a run:
    `generation.max_new_tokens`, which also caps what a request may ask for)."""

    @model_validator(mode="after")
    def _check(self) -> "ServingConfig":
        checks = [
            (0 <= self.port <= 65535, f"port={self.port} must be in [0, 65535] (0: a free port)"),
            (self.max_request_bytes >= 1, "max_request_bytes must be >= 1"),
            (self.max_batch_size >= 1, "max_batch_size must be >= 1"),
            (self.max_queued_requests >= 1, "max_queued_requests must be >= 1"),
            (not self.allow_remote or is_loopback(self.host) or bool(self.token_env), _NO_TOKEN.format(self.host)),
            (self.batch_wait_s >= 0, "batch_wait_s must be >= 0"),
            (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"endpoint {message}")
        return self
