"""Typed configuration: the schema and its YAML/override loader.

Imported lazily: components define their config classes next to their code on top of
`reinforge.config.section`, and the schema imports those components' modules, so importing this
package must not import the schema first.
"""

from typing import Any

__all__ = ["Config", "all_keys", "build_config", "load_config", "save_config"]


def __getattr__(name: str) -> Any:
    if name == "Config":
        from reinforge.config.schema import Config

        return Config
    if name in ("all_keys", "build_config", "load_config", "save_config"):
        from reinforge.config import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'reinforge.config' has no attribute {name!r}")
