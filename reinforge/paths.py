"""Where relative paths in configs point."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str | Path) -> Path:
    """A relative path is taken from the working directory if it exists there, else from the project
    root, so `reinforge demo` finds the shipped model and data from any directory."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        return path
    shipped = PROJECT_ROOT / path
    return shipped if shipped.exists() else path
