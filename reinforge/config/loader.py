"""YAML files with `defaults:` inheritance and `a.b.c=value` overrides, into a recipe's typed root config.

- A file may name a parent (or a list of parents) with `defaults: parent.yaml`, relative to itself;
  the child's keys win, key by key.
- Overrides `section.key=value` are parsed as YAML scalars (`true`, `1e-4`, `[a, b]`, `null`) and
  type-checked against the schema.
- Unknown keys, in files or overrides, are errors that name the key and the nearest valid key.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from reinforge.config.section import Section
from reinforge.config.tree import deep_merge, set_dotted
from reinforge.errors import ConfigError

RootT = TypeVar("RootT", bound=Section)


def load_recipe_config(schema: type[RootT], path: str | Path | None, overrides: list[str] = ()) -> RootT:
    """Build a recipe's root config (GRPO's `GRPORunConfig`, SFT's `SFTRunConfig`, ...) from an optional YAML file
    plus `key=value` overrides."""
    tree = read_yaml_tree(Path(path)) if path is not None else {}
    for override in overrides:
        key, value = parse_override(override, schema)
        set_dotted(tree, key, value)
    return build_config(tree, schema)


def build_config(tree: dict[str, Any], schema: type[RootT]) -> RootT:
    """Validate a nested dict against the schema, with one-line errors."""
    _check_keys(tree, schema, schema, prefix="")
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc)) from None


def save_config(config: Section, path: Path) -> None:
    """Write the fully resolved config; loading it again reproduces the run."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    path.write_text(text)


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts (leaves and sections)."""
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        sub = _section_type(field.annotation)
        if sub is not None:
            keys.extend(all_keys(sub, dotted + "."))
    return keys


def moved_keys(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Old key -> its new place: the root's `moved_keys` (dotted from the root) and each section's own (dotted from
    that section, so a section shared by several recipes carries its moves to all of them)."""
    moved = {f"{prefix}{old}": f"{prefix}{new}" for old, new in getattr(model, "moved_keys", {}).items()}
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            moved |= moved_keys(sub, f"{prefix}{name}.")
    return moved


def read_yaml_mapping(path: Path, what: str, expected: str) -> dict[str, Any]:
    """The YAML mapping in `path`, or a one-line ConfigError naming the file (and line) and what it should hold."""
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{what} {path}{line} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{what} {path} must hold {expected}, not a {type(tree).__name__}")
    return tree


def read_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file with --config")
    if path in seen:
        raise ConfigError(f"config file {path} inherits from itself through `defaults:`; remove the cycle")
    tree = read_yaml_mapping(path, "config file", "a mapping of sections")
    parents = tree.pop("defaults", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict[str, Any] = {}
    for parent in parents:
        deep_merge(merged, read_yaml_tree(path.parent / parent, seen + (path,)))
    deep_merge(merged, tree)
    return merged


def parse_override(text: str, schema: type[BaseModel]) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. loop.max_steps=10)")
    annotation = _annotation_at(key, schema)
    if raw.strip() in ("null", "None", "~"):
        return key, None
    if annotation is not None and _accepts_str(annotation) and not _accepts_container(annotation):
        return key, raw  # keep "123" a string where a string is expected
    try:
        return key, yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return key, raw


def _check_keys(tree: dict[str, Any], schema: type[BaseModel], model: type[BaseModel], prefix: str) -> None:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(key)
        if field is None:
            while isinstance(value, dict) and value:  # name the setting, not just its unknown section
                key, value = next(iter(value.items()))
                dotted = f"{dotted}.{key}"
            raise ConfigError(_unknown_key_message(dotted, schema))
        sub = _section_type(field.annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(value, schema, sub, dotted + ".")


def _unknown_key_message(dotted: str, schema: type[BaseModel]) -> str:
    """The key, which recipe lacks it, and the nearest key it does have: an old key's new place (`moved_keys`), the
    same setting in another section (one that another recipe has there), else a near spelling; else what it has
    instead."""
    keys = [k for k in all_keys(schema) if _section_type(_annotation_at(k, schema)) is None]  # settings, not sections
    recipe = getattr(schema, "recipe", "")
    who = f"reinforge {recipe}" if recipe else "this config"
    section, _, leaf = dotted.rpartition(".")
    top = dotted.split(".")[0]
    no_section = bool(section) and top not in schema.model_fields
    missing = f"{who} has no {top} section" if no_section else f"{who} has no such setting"
    moved = moved_keys(schema)  # old key -> its new place, for configs of an earlier version
    leaf_of = {k: k.rpartition(".")[2] for k in keys}
    in_section = [k for k in keys if k.rpartition(".")[0] == section]
    match = (
        [moved[old] for old in difflib.get_close_matches(dotted, moved, n=1, cutoff=0.7)]
        or [k for k in keys if leaf_of[k] == leaf]
        or [k for k in in_section if leaf_of[k] in difflib.get_close_matches(leaf, [leaf_of[k] for k in in_section])]
        or [k for k in keys if leaf_of[k] in difflib.get_close_matches(leaf, list(leaf_of.values()), cutoff=0.75)]
    )
    if match:
        hint = f"; did you mean {match[0]}?"
    elif in_section:
        hint = f"; its {section} settings are {', '.join(leaf_of[k] for k in in_section)}"
    else:
        hint = f"; its sections are {', '.join(schema.model_fields)}"
    return f"unknown config key {dotted}: {missing}{hint}"


def _describe_validation_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"]
    if first["type"] == "value_error":  # our cross-field checks: the message already names the fields
        return message.removeprefix("Value error, ")
    got = first.get("input")
    return f"config key {where}: {message} (got {got!r})"


def _annotation_at(dotted: str, schema: type[BaseModel]) -> Any:
    model: type[BaseModel] | None = schema
    annotation = None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = _section_type(annotation)
    return annotation


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _accepts_str(annotation: Any) -> bool:
    return any(arg is str for arg in _union_args(annotation))


def _accepts_container(annotation: Any) -> bool:
    return any(typing.get_origin(arg) in (list, dict, tuple) for arg in _union_args(annotation))
