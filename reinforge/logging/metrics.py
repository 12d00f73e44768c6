"""Timers, the metrics.jsonl writer and the ledgers' repair at resume. Every metric's formula is in docs/metrics.md.

The ledgers (RUN_DIR/metrics.jsonl, RUN_DIR/prompts.jsonl: one JSON object per line, each with its `step`) are
appended through the page cache and flushed to disk (fsync) with the checkpoint they belong to
(loops/checkpointing.py), so what a checkpoint covers survives a power loss. What came after it may not: a line cut
mid-write, or a tail of NUL bytes (a file the kernel had grown but not yet filled, a full disk). `cut_ledger` reads
a ledger back at resume whatever its tail holds (docs/reliability.md, "Ledgers").
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from reinforge.run_dir import atomic_write_text


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
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, written at once (a killed process loses nothing);
    flushed to disk with each checkpoint (a power loss loses nothing the checkpoint covers)."""

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


def read_ledger(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a ledger (its lines that are JSON objects with a `step`), and how many of its bytes are not
    (torn lines, NUL bytes); a missing file has none."""
    if not path.exists():
        return [], 0
    rows, unreadable = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip(b" \t\r\0"):
            unreadable += len(line)  # a NUL-filled block (or an empty line)
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            unreadable += len(line)
    return rows, unreadable


def cut_ledger(path: Path, last_step: int, aside: Path, notice: Callable[[str], None] = print) -> None:
    """Keep the rows of steps <= `last_step` (a checkpoint's: the steps after it are redone) and append the others
    to `aside`; drop what is not a row (a torn line, NUL bytes), with one line to `notice`, which also says when
    rows of the checkpoint's steps (1 to `last_step`, one each) are missing. Replaced atomically."""
    rows, unreadable = read_ledger(path)
    later = [row for row in rows if row["step"] > last_step]
    first_missing = max((row["step"] + 1 for row in rows if row["step"] <= last_step), default=1)
    missing = path.exists() and first_missing <= last_step
    parts = [f"cut {unreadable} bytes that are not a JSON row (a line torn by a crash, or NUL bytes left by a power "
             "loss or a full disk)"] if unreadable else []  # fmt: skip
    if missing:
        parts.append(f"its rows of steps {first_missing}-{last_step}, which the checkpoint covers, are missing")
    elif unreadable:
        parts.append(f"the rows up to step {last_step}, which its checkpoint covers, are whole")
    if parts:
        notice(f"{path}: at resume, " + "; ".join(parts))
    if later:
        with aside.open("a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in later))
            handle.flush()
            os.fsync(handle.fileno())
    if later or unreadable or not _ends_a_line(path):
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows if row["step"] <= last_step))


def _ends_a_line(path: Path) -> bool:
    """Empty or missing, or its last byte a newline (a row cut right before it would join the next one appended)."""
    if not path.exists() or path.stat().st_size == 0:
        return True
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"
