"""reinforge as a Tinker backend: the Tinker API's service over reinforge's training backend and generation engines."""
