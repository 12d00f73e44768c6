"""Typed configuration machinery: the base section, YAML loading with `defaults:`, `key=value` overrides, errors.

The sections themselves live beside the components they configure, and each recipe assembles its root tree from
them (algorithms/grpo_config.py's `GRPORunConfig`, algorithms/sft_config.py's `SFTRunConfig`, ...); this package
knows none of them.
"""
