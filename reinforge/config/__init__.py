"""Typed configuration: the schema and its YAML/override loader."""

from reinforge.config.loader import all_keys, build_config, load_config, save_config
from reinforge.config.schema import Config

__all__ = ["Config", "all_keys", "build_config", "load_config", "save_config"]
