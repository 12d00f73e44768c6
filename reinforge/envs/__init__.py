"""Environments: score (and optionally continue) conversations."""
