"""Reading JSONL datasets with errors that name the file and the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from reinforge.errors import DataError


def decode_line(raw: bytes, path: Path, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}:{line_number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            "save the file as UTF-8"
        ) from None


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each non-blank line, read lazily: a file larger than memory streams."""
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            line = decode_line(raw, path, line_number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{line_number}: malformed JSON ({exc.msg} at column {exc.colno}); fix or remove that line"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_number}: expected a JSON object per line, got {type(record).__name__}")
            yield line_number, record


def read_jsonl(path: str | Path, required_keys: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """All records of a JSONL file; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist; check the path (data.train_path / data.val_path)")
    records = []
    for line_number, record in iter_jsonl(path):
        missing = [key for key in required_keys if key not in record]
        if missing:
            raise DataError(
                f"{path}:{line_number}: record has no {', '.join(missing)} field; "
                f"every record needs {', '.join(required_keys)}"
            )
        records.append(record)
    if not records:
        raise DataError(f"dataset file {path} holds no records")
    return records
