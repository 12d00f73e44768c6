"""YAML files with `defaults:` inheritance and `a.b.c=value` overrides, into the typed `Config`.

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

from reinforge.config.schema import Config
from reinforge.config.section import Section
from reinforge.config.tree import deep_merge, set_dotted
from reinforge.errors import ConfigError

RootT = TypeVar("RootT", bound=Section)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Build the GRPO config from an optional YAML file plus `key=value` overrides."""
    return load_recipe_config(Config, path, overrides)


def load_recipe_config(schema: type[RootT], path: str | Path | None, overrides: list[str] = ()) -> RootT:
    """Build any root config (`Config`, or a recipe's own tree such as SFT's) from an optional YAML file
    plus `key=value` overrides."""
    tree = read_yaml_tree(Path(path)) if path is not None else {}
    for override in overrides:
        key, value = parse_override(override, schema)
        set_dotted(tree, key, value)
    return build_config(tree, schema)


def build_config(tree: dict[str, Any], schema: type[RootT] = Config) -> RootT:
    """Validate a nested dict against the schema, with one-line errors."""
    _check_keys(tree, schema, schema, prefix="")
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc)) from None


def save_config(config: Config, path: Path) -> None:
    """Write the fully resolved config; loading it again reproduces the run."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    path.write_text(text)


def all_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts (leaves and sections)."""
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        sub = _section_type(field.annotation)
        if sub is not None:
            keys.extend(all_keys(sub, dotted + "."))
    return keys


def read_yaml_mapping(path: Path, what: str, expected: str) -> dict[str, Any]:
    """The YAML mapping in `path`, or a one-line ConfigError naming the file (and line) and what it should hold."""
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
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


def parse_override(text: str, schema: type[BaseModel] = Config) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. grpo.max_steps=10)")
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
            raise ConfigError(_unknown_key_message(dotted, schema))
        sub = _section_type(field.annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(value, schema, sub, dotted + ".")


def _unknown_key_message(dotted: str, schema: type[BaseModel]) -> str:
    keys = all_keys(schema)
    section = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    same_section = [k for k in keys if k.startswith(section) and k.count(".") == dotted.count(".")]
    match = difflib.get_close_matches(dotted, same_section, n=1, cutoff=0.5) or difflib.get_close_matches(
        dotted, keys, n=1, cutoff=0.5
    )
    hint = f"; did you mean {match[0]}?" if match else f"; the sections are {', '.join(schema.model_fields)}"
    return f"unknown config key {dotted}{hint}"


def _describe_validation_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"]
    if first["type"] == "value_error":  # our cross-field checks: the message already names the fields
        return message.removeprefix("Value error, ")
    got = first.get("input")
    return f"config key {where}: {message} (got {got!r})"


def _annotation_at(dotted: str, schema: type[BaseModel] = Config) -> Any:
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
