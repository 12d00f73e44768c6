"""User-facing errors.

A `ReinforgeError` is something the user can fix (a config key, a path, a data file). The CLI prints
its message on one line and exits with status 2, never a traceback. An `InfrastructureError` is a failure of the
machinery, not of the input (a worker process that died, a wait past its deadline): the CLI prints its line and exits
with status 75 (EX_TEMPFAIL), and a supervised run restarts from its last checkpoint (reinforge/supervisor.py).
Internal invariants use `assert` instead.
"""


class ReinforgeError(ValueError):
    """A problem with the user's input, with a message that says what to fix."""


class ConfigError(ReinforgeError):
    """An invalid configuration key, value or combination of values."""


class DataError(ReinforgeError):
    """A dataset file that is missing or malformed."""


class InfrastructureError(ReinforgeError):
    """A component of the run died or stopped answering; running again from the last checkpoint may succeed."""
