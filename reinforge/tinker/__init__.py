"""A Tinker-compatible service over reinforge's training backend and generation engines (docs/tinker.md)."""
