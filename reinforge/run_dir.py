"""The run directory: created without clobbering another run, written to atomically."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from reinforge.errors import ConfigError

RUN_DIR_FILE_ENV = "REINFORGE_RUN_DIR_FILE"  # set by reinforge/supervisor.py: where a run says where it writes


_announced: list[Path] = []  # the run directory of this process's run, once it has one


def announce_run_dir(run_dir: Path) -> None:
    """Tell the supervisor, if there is one, which run directory the run writes to (a restart resumes there), and
    the CLI (`announced_run_dir`: where a bug's traceback goes)."""
    _announced[:] = [Path(run_dir).resolve()]
    if path := os.environ.get(RUN_DIR_FILE_ENV):
        Path(path).write_text(str(Path(run_dir).resolve()))


def announced_run_dir() -> Path | None:
    return _announced[0] if _announced else None


def check_run_dir(requested: str | Path, what: str = "logging.run_dir") -> None:
    """A one-line ConfigError now, before any work, if the directory could not be made: the nearest existing
    ancestor is a file, or cannot be written to."""
    ancestor = Path(requested).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if ancestor != Path(requested).absolute() and not ancestor.is_dir():
        raise ConfigError(f"{what}={requested}: {ancestor} is a file, not a directory; choose another path")
    if not os.access(ancestor if ancestor.is_dir() else ancestor.parent, os.W_OK):
        raise ConfigError(
            f"{what}={requested}: {ancestor} is not writable; choose a path in a directory you can write to"
        )


def make_run_dir(requested: str | Path, what: str = "logging.run_dir") -> Path:
    """Create the run directory; if it already holds a run, use the first free `<dir>-N` beside it."""
    path = Path(requested)
    candidate, suffix = path, 0
    try:
        while candidate.exists() and (not candidate.is_dir() or any(candidate.iterdir())):
            suffix += 1
            candidate = path.with_name(f"{path.name}-{suffix}")
        candidate.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a directory should be, no permission, a read-only disk
        raise ConfigError(
            f"{what}={requested}: cannot create the run directory ({exc.strerror}: {exc.filename}); "
            "choose a path in a directory you can write to"
        ) from None
    return candidate


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` with one rename, so readers
    only ever see a complete directory (or the previous one). On failure the temporary one is removed.
    Durable: every file and directory in it is flushed to disk (fsync) before the rename, and the parent
    directory after it, so a power loss cannot leave `final` renamed into place but empty, and whatever
    the caller deletes after this returns (older checkpoints) is gone only once `final` is on disk."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: Path | str) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def atomic_write_text(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a part: write a sibling, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
