"""The training data a checkpoint was trained on, pinned so that a resume notices an edited file.

A local file is pinned by its size, its modification time and a SHA-256 of its bytes; a local directory (a saved
`datasets` dataset, a folder of data files) by the same of each of its files. Up to `FULL_DIGEST_BYTES` the digest
reads everything; above, it reads `SAMPLED_BLOCKS` blocks of `BLOCK_BYTES` at evenly spaced offsets (the first and
the last among them) and the size, so pinning a multi-terabyte set on a network disk reads 256 MiB, not the set. A
digest is computed once per process and file (reused while the size and time stay), and a resume whose file has the
pinned size and time reads nothing. A Hugging Face hub name is pinned by name only (pin its revision in the name).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from reinforge.paths import resolve_path

FULL_DIGEST_BYTES = 8 << 30
BLOCK_BYTES = 1 << 20
SAMPLED_BLOCKS = 256
_digests: dict[tuple[str, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> digest, this process's


def pin(path: str) -> dict[str, Any]:
    """{path, files: {name: {size, mtime_ns, digest}}, digest_kind} of a local file ("" names it) or directory;
    {path} of a name that is neither (a hub dataset)."""
    local = resolve_path(path)
    files = _files(local)
    if files is None:
        return {"path": path}
    total = sum(stat.st_size for _, stat in files)
    kind = "sha256" if total <= FULL_DIGEST_BYTES else f"sha256 of {SAMPLED_BLOCKS} sampled 1 MiB blocks per file"
    pinned = {name: _stamp(stat) | {"digest": _digest(local / name, stat, total)} for name, stat in files}
    return {"path": path, "files": pinned, "digest_kind": kind}


def changed(pinned: dict[str, Any], path: str) -> str | None:
    """How the data at `path` differs from `pinned` (None: it does not, or it cannot be told, as for a hub name)."""
    if "files" not in pinned:
        return None
    local = resolve_path(path)
    files = _files(local)
    if files is None:
        return f"{local} is gone"
    then = pinned["files"]
    now = {name: _stamp(stat) for name, stat in files}
    if now == {name: _stamp(entry) for name, entry in then.items()}:  # any write sets the modification time
        for name, stat in files:  # known: the next checkpoint's pin reads nothing
            _digests[_key(local / name, stat)] = then[name]["digest"]
        return None
    before, after = sum(f["size"] for f in then.values()), sum(f["size"] for f in now.values())
    if sorted(now) != sorted(then) or before != after:
        return f"{local} was {before} bytes in {len(then)} file(s) and is {after} bytes in {len(now)}"
    if {name: entry["digest"] for name, entry in pin(path)["files"].items()} != {
        name: entry["digest"] for name, entry in then.items()
    }:  # the same size at another time: a copy or a touch (resumed), or an edit
        return f"{local} has its size but other content (its {pinned['digest_kind']} differs)"
    return None


def _stamp(stat: os.stat_result | dict[str, Any]) -> dict[str, int]:
    if isinstance(stat, dict):
        return {"size": stat["size"], "mtime_ns": stat["mtime_ns"]}
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _key(path: Path, stat: os.stat_result) -> tuple[str, int, int, int]:
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)


def _files(local: Path) -> list[tuple[str, os.stat_result]] | None:
    """(name relative to `local`, stat) of a file ("" names itself) or of a directory's files (hidden ones skipped)."""
    if local.is_file():
        return [("", local.stat())]
    if not local.is_dir():
        return None
    found = []
    for directory, dirs, names in os.walk(local):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            found.append((str((Path(directory) / name).relative_to(local)), (Path(directory) / name).stat()))
    return found


def _digest(path: Path, stat: os.stat_result, total: int) -> str:
    key = _key(path, stat)
    if key not in _digests:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            if total <= FULL_DIGEST_BYTES or stat.st_size <= SAMPLED_BLOCKS * BLOCK_BYTES:
                digest = hashlib.file_digest(handle, "sha256")
            else:
                last = stat.st_size - BLOCK_BYTES
                for index in range(SAMPLED_BLOCKS):
                    handle.seek(last * index // (SAMPLED_BLOCKS - 1))
                    digest.update(handle.read(BLOCK_BYTES))
        _digests[key] = digest.hexdigest()
    return _digests[key]
