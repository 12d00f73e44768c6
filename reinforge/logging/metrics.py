"""Timers and the metrics.jsonl writer. Every metric's formula is in docs/metrics.md."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class Timers:
    """Wall-clock seconds per named phase; `timing/<name>_s` in the metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{name}_s": seconds for name, seconds in self.seconds.items()}


class JsonlWriter:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed at once so a crash loses nothing."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
