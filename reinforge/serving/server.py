"""The endpoint's life: one uvicorn server on a thread beside the engine, and, inside a GRPO run, the
rollout sessions during which agents may call it.

Standalone (`reinforge serve`) every request is served with the settings it asks for. In a run the
endpoint is *managed*: it answers only while a rollout is under way (`session`), with the run's
sampling settings (a request that asks for another temperature or top_p gets HTTP 400; the length
is capped at `generation.max_new_tokens` per call), and records what it generated for the rollout
to rebuild its trajectories from. Between rollouts the trainer owns the engine (refit, validation
by the run itself), and requests get HTTP 503.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from transformers import PreTrainedTokenizerBase

from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.serving.batcher import Batcher
from reinforge.serving.config import ServingConfig
from reinforge.serving.recorder import CallRecorder
from reinforge.serving.threaded import ThreadedServer


@dataclass
class RolloutSession:
    """One rollout's worth of agent traffic: its sampling settings and what the endpoint generated."""

    sampling: SamplingParams  # temperature, top_p, top_k, max_new_tokens (per call) and the seed stream
    recorder: CallRecorder = field(default_factory=CallRecorder)
    open_episodes: set[str] = field(default_factory=set)
    num_running: int = 0  # episodes in flight, Python or Gym: the batcher's hint
    closed: bool = False


class PolicyServer:
    """The OpenAI-compatible endpoint over `engine` (serving/app.py has the routes)."""

    def __init__(
        self,
        engine: GenerationBackend,
        tokenizer: PreTrainedTokenizerBase,
        config: ServingConfig,
        *,
        max_model_len: int,
        default_max_tokens: int,
        managed: bool,
        token: str | None = None,
    ):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.max_model_len, self.default_max_tokens, self.managed, self.token = (
            max_model_len,
            default_max_tokens,
            managed,
            token,
        )
        self.model_name = config.model_name
        self.batcher = Batcher(engine, config.max_batch_size, config.batch_wait_s, self._num_running)
        self.lock = threading.Lock()  # guards `session` against a request being admitted as it closes
        self.session: RolloutSession | None = None
        self._episode_ids = itertools.count()
        self.counts = {"requests": 0, "rejected": 0}
        self._http: ThreadedServer | None = None

    @property
    def url(self) -> str:
        """http://HOST:PORT (the `/v1` base URL of the OpenAI client is `base_url`)."""
        assert self._http is not None, "start the endpoint first"
        return self._http.url

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def episode_base_url(self, episode_id: str) -> str:
        """The `base_url` of one episode: its calls are recorded under its id."""
        return f"{self.url}/episodes/{episode_id}/v1"

    def start(self) -> "PolicyServer":
        from reinforge.serving.app import build_app

        self._http = ThreadedServer(build_app(self), self.config.host, self.config.port, "policy endpoint").start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop()
        self.batcher.close()

    @contextmanager
    def rollout_session(self, sampling: SamplingParams) -> Iterator[RolloutSession]:
        """Agents may call the endpoint while this is open; on exit new calls are refused, those in
        flight are answered, and what nobody took is forgotten."""
        session = RolloutSession(sampling=sampling)
        with self.lock:
            assert self.session is None, "one rollout session at a time"
            self.session = session
        try:
            yield session
        finally:
            with self.lock:
                session.closed = True
                self.session = None
            self.batcher.drain()
            session.recorder.clear()

    @contextmanager
    def episode(self, session: RolloutSession, keyed: bool) -> Iterator[str | None]:
        """One episode in flight; `keyed`: it gets an id of its own (its `episode_base_url`), else None."""
        episode_id = f"ep{next(self._episode_ids)}-{uuid.uuid4().hex[:8]}" if keyed else None
        with self.lock:
            session.num_running += 1
            if episode_id:
                session.open_episodes.add(episode_id)
        try:
            yield episode_id
        finally:
            with self.lock:
                session.num_running -= 1
                session.open_episodes.discard(episode_id)

    def _num_running(self) -> int:
        session = self.session
        return session.num_running if session is not None else 0

    def metrics(self) -> dict[str, float]:
        """The endpoint's counts since the last call (requests, engine calls, batch sizes), then reset."""
        with self.lock:
            counts, self.counts = dict(self.counts), dict.fromkeys(self.counts, 0)
        return {**{k: float(v) for k, v in counts.items()}, **self.batcher.metrics()}
