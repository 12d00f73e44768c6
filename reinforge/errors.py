"""User-facing errors.

A `ReinforgeError` is something the user can fix (a config key, a path, a data file). The CLI prints
its message on one line and exits with status 2, never a traceback. Internal invariants use
`assert` instead.
"""


class ReinforgeError(ValueError):
    """A problem with the user's input, with a message that says what to fix."""


class ConfigError(ReinforgeError):
    """An invalid configuration key, value or combination of values."""


class DataError(ReinforgeError):
    """A dataset file that is missing or malformed."""
