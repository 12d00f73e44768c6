"""Loading a recipe's own config tree (`reinforge dpo`, `reinforge rm`) from YAML and overrides.

Same rules as `loader.py` (which builds the GRPO `Config`): `defaults:` inheritance, `a.b=value`
overrides parsed as YAML scalars and type-checked, unknown keys named with the nearest valid key of
*this* tree, cross-field checks reported on one line. Only the root section differs.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from reinforge.config.loader import (
    _accepts_container,
    _accepts_str,
    _describe_validation_error,
    _read_yaml_tree,
    _section_type,
    _set_dotted,
    all_keys,
)
from reinforge.config.section import Section
from reinforge.errors import ConfigError

RootT = TypeVar("RootT", bound=Section)


def load_recipe_config(schema: type[RootT], path: str | Path | None, overrides: list[str] = ()) -> RootT:
    """Build `schema` from an optional YAML file plus `key=value` overrides."""
    tree = _read_yaml_tree(Path(path)) if path is not None else {}
    for override in overrides:
        key, value = _parse_override(schema, override)
        _set_dotted(tree, key, value)
    _check_keys(schema, tree, schema, prefix="")
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc)) from None


def _parse_override(schema: type[Section], text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. training.lr=1e-5)")
    if raw.strip() in ("null", "None", "~"):
        return key, None
    annotation = _annotation_at(schema, key)
    if annotation is not None and _accepts_str(annotation) and not _accepts_container(annotation):
        return key, raw  # keep "123" a string where a string is expected
    try:
        return key, yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return key, raw


def _check_keys(schema: type[Section], tree: dict[str, Any], model: type[Section], prefix: str) -> None:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(key)
        if field is None:
            raise ConfigError(_unknown_key_message(schema, dotted))
        sub = _section_type(field.annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(schema, value, sub, dotted + ".")


def _unknown_key_message(schema: type[Section], dotted: str) -> str:
    keys = all_keys(schema)
    section = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    same_section = [k for k in keys if k.startswith(section) and k.count(".") == dotted.count(".")]
    match = difflib.get_close_matches(dotted, same_section, n=1, cutoff=0.5) or difflib.get_close_matches(dotted, keys, n=1, cutoff=0.5)
    hint = f"; did you mean {match[0]}?" if match else f"; the sections are {', '.join(schema.model_fields)}"
    return f"unknown config key {dotted}{hint}"


def _annotation_at(schema: type[Section], dotted: str) -> Any:
    model, annotation = schema, None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = _section_type(annotation)
    return annotation
