"""Timers and the metrics.jsonl writer. Every metric's formula is in docs/metrics.md."""

from __future__ import annotations

import json
import math
import threading
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


class RoundMetrics:
    """The metrics of the rollouts since the last `take`, from any thread: one per step in sync and async runs,
    one per prompt group in flight. Merged key by key: a maximum (`..._max`) the largest, a mean, fraction or
    rate (`mean` or `fraction` in the name, `..._per_s`) the mean, every other value (a count, seconds) the sum."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rounds: list[dict[str, float]] = []

    def add(self, metrics: dict[str, float]) -> None:
        with self._lock:
            self._rounds.append(metrics)

    def take(self) -> dict[str, float]:
        with self._lock:
            rounds, self._rounds = self._rounds, []
        merged: dict[str, float] = {}
        for name in dict.fromkeys(name for metrics in rounds for name in metrics):
            values = [metrics[name] for metrics in rounds if name in metrics]
            if name.endswith("_max"):
                merged[name] = max(values)
            elif "mean" in name or "fraction" in name or name.endswith("_per_s"):
                merged[name] = sum(values) / len(values)
            else:
                merged[name] = sum(values)
        return merged


class JsonlWriter:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed at once so a crash loses nothing."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: json_value(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def json_value(value: float) -> float | str:
    """A metric as metrics.jsonl holds it: a number, or "nan", "inf", "-inf" for a non-finite one (visible, and
    strict JSON, which has no NaN; `float()` reads them back)."""
    value = float(value)
    return value if math.isfinite(value) else str(value)
