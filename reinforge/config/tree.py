"""Plain nested-dict helpers for config trees (no schema): dotted keys, merging."""

from __future__ import annotations

from typing import Any


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys of the config overrides (empty dicts stay leaves)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> None:
    """Merge `update` into `base` in place: nested mappings merge, anything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """tree["a"]["b"] = value for key "a.b", making the mappings on the way."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
