"""Client sessions: one per `ServiceClient`, kept alive by its heartbeat (every 10 s from the SDK). A session silent
for `tinker.heartbeat_timeout_s`, or finished by the client (`ServiceClient.close`), is closed: the service frees
what it owned (its training clients' models, its sampling sessions) through the `on_close` callback."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from reinforge.tinker.errors import SessionClosed, UnknownResource

logger = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    last_seen: float
    metadata: dict = field(default_factory=dict)
    model_ids: set[str] = field(default_factory=set)
    sampler_ids: set[str] = field(default_factory=set)
    closed: str = ""  # why, once closed


class Sessions:
    """The live sessions and the reaper thread that closes silent ones."""

    def __init__(self, heartbeat_timeout_s: float, on_close: Callable[[Session], None]) -> None:
        self.timeout_s = heartbeat_timeout_s
        self._on_close = on_close
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="reinforge-tinker-reaper", daemon=True)

    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()

    def create(self, metadata: dict) -> Session:
        session = Session(uuid.uuid4().hex[:16], time.monotonic(), metadata)
        with self._lock:
            self._sessions[session.session_id] = session
        logger.info("session %s opened", session.session_id)
        return session

    def get(self, session_id: str) -> Session:
        """The open session; `SessionClosed` (410) once closed, `UnknownResource` (404) if never opened here."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise UnknownResource(f"unknown session {session_id!r}: create one with a new ServiceClient")
        if session.closed:
            raise SessionClosed(f"session {session_id} is closed ({session.closed}); create a new ServiceClient")
        return session

    def heartbeat(self, session_id: str) -> None:
        self.get(session_id).last_seen = time.monotonic()

    def touch(self, session_id: str) -> None:
        """A sign of life other than a heartbeat (a poll of one of its futures)."""
        session = self._sessions.get(session_id)
        if session is not None and not session.closed:
            session.last_seen = time.monotonic()

    def close(self, session_id: str, reason: str) -> None:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.closed:
                return
            session.closed = reason
        logger.info("session %s closed: %s", session_id, reason)
        self._on_close(session)

    def live(self) -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.closed]

    def _reap(self) -> None:
        period = min(5.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            for session in self.live():
                silent = now - session.last_seen
                if silent > self.timeout_s:
                    self.close(
                        session.session_id,
                        f"no heartbeat for {silent:.0f} s > tinker.heartbeat_timeout_s={self.timeout_s:g}",
                    )
