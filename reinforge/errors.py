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


class NumericalError(ReinforgeError):
    """Training produced a non-finite loss, gradient or parameter too many steps in a row. Not restarted: exact
    resume would meet the same numbers again; the fix is the user's (a lower learning rate, a data row), and a run
    started again resumes from its last checkpoint, which is always finite."""


# errno values of an operating-system failure that a later attempt may not meet: a stale NFS handle, a full disk (space
# may come back), an I/O error, a connection reset or refused, a timeout. Anything else an OSError says (no such file,
# permission denied, not a directory) is the input's and repeats.
TRANSIENT_ERRNOS = frozenset(
    getattr(__import__("errno"), name)
    for name in (
        "ESTALE", "ENOSPC", "EIO", "EAGAIN", "EBUSY", "EDQUOT", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED",
        "ECONNABORTED", "EPIPE", "ENETUNREACH", "EHOSTUNREACH", "ENETDOWN", "EHOSTDOWN",
    )
)  # fmt: skip


def is_transient(exc: BaseException) -> bool:
    """Whether an exception raised by a component is one a restart from the last checkpoint can fix (an infrastructure
    failure, a transient OS or network error) rather than a bug or bad input that would repeat at the same step."""
    if isinstance(exc, InfrastructureError):
        return True
    if isinstance(exc, ReinforgeError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if type(exc).__name__ == "CheckpointException":  # torch.distributed.checkpoint's: {rank: (exception, traceback)}
        failures = [failure[0] for failure in getattr(exc, "failures", {}).values()]
        return bool(failures) and all(is_transient(failure) for failure in failures)
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS
