"""How a run's process ends: its exit status from the exception it ends with (`exit_status`: which failures a restart
can fix), its last line that reaches whoever watches it (`console_line`), and the heartbeat its supervisor watches
(`start_heartbeat`, reinforge/supervisor.py). The deadline of its end is hang.py's (`bound_exit`)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from reinforge.errors import ReinforgeError, is_transient

INFRASTRUCTURE_EXIT = 75  # EX_TEMPFAIL: an InfrastructureError or a transient failure; a supervisor restarts the run
INPUT_EXIT, INTERRUPTED_EXIT = 2, 130  # a ReinforgeError or a bug (never restarted); Ctrl-C
HEARTBEAT_ENV = "REINFORGE_HEARTBEAT"  # set by the supervisor: "<seconds between beats>:<file to touch>"

HTTP_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
HTTP_LIBRARIES = ("requests", "urllib3", "httpx", "httpcore", "aiohttp")
HTTP_TRANSPORT_ERRORS = frozenset(
    {"ConnectionError", "Timeout", "TimeoutException", "TransportError", "ChunkedEncodingError", "ProtocolError",
     "ReadTimeoutError", "NewConnectionError", "ClientConnectionError", "ServerTimeoutError", "ClientPayloadError"}
)  # fmt: skip
FAILED_WRITES = ("PytorchStreamWriter failed writing", "file write failed")  # torch.save on a full or failing disk


def restartable(exc: BaseException | None) -> bool:
    """Whether a run that ended with `exc` may get further from its last checkpoint: `errors.is_transient` (an
    InfrastructureError, a connection error, a stale handle, a full disk), an HTTP library's transport error or a
    408/429/5xx answer, torch's checkpoint writer failing on a full or failing disk; or one of these as the explicit
    cause (`raise ... from`) of `exc`. A `ReinforgeError` says for itself; anything else (a KeyError) is a bug."""
    for _ in range(8):  # the explicit causes, not the context: a bug while handling a transient error stays a bug
        if exc is None:
            return False
        if isinstance(exc, ReinforgeError) or is_transient(exc):
            return is_transient(exc)
        if _transient_http(exc) or (isinstance(exc, RuntimeError) and any(text in str(exc) for text in FAILED_WRITES)):
            return True
        reason = getattr(exc, "reason", None)  # urllib's URLError carries the socket's error
        exc = reason if isinstance(reason, BaseException) else exc.__cause__
    return False


def _transient_http(exc: BaseException) -> bool:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status is None and type(exc).__module__ == "urllib.error":
        status = getattr(exc, "code", None)
    if isinstance(status, int):
        return status in HTTP_RETRY_STATUSES
    names = {cls.__name__ for cls in type(exc).__mro__}
    return type(exc).__module__.split(".")[0] in HTTP_LIBRARIES and bool(names & HTTP_TRANSPORT_ERRORS)


def exit_status(exc: BaseException | None) -> int:
    """The CLI's exit status for a run that ended with `exc` (None: it did not): 0; 130 interrupted; 75
    (restarted by a supervisor) when `restartable`; 2 for the input's errors and bugs (never restarted)."""
    if exc is None:
        return 0
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED_EXIT
    return INFRASTRUCTURE_EXIT if restartable(exc) else INPUT_EXIT


_console_fd: int | None = None


def keep_console() -> None:
    """Keep this process's fd 2 as it is now (the terminal, or the supervisor's pipe) for `console_line`; the CLI
    calls it before the run points fd 2 at its log file (logging/capture.py)."""
    global _console_fd
    if _console_fd is None:
        try:
            _console_fd = os.dup(2)
        except OSError:  # no fd 2 at all
            pass


def console_line(text: str) -> None:
    """`text` on the kept console, and on stderr when that is another file now (the run's log): a process's last line
    reaches whoever watches it, the supervisor included, while the log keeps it too."""
    data = (text + "\n").encode()
    if _console_fd is not None and not _same_file(_console_fd, 2):
        try:
            os.write(_console_fd, data)
        except OSError:
            pass
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # closed
        pass


def _same_file(fd: int, other: int) -> bool:
    try:
        first, second = os.fstat(fd), os.fstat(other)
    except OSError:
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def start_heartbeat() -> None:
    """In a supervised run's process (HEARTBEAT_ENV set, by the supervisor): touch the supervisor's file every few
    seconds from a daemon thread of its own, whatever the main thread does. A long call (a model load, a checkpoint)
    does not stop it; a stopped process, or one wedged in C code that holds the GIL, misses beats."""
    spec = os.environ.pop(HEARTBEAT_ENV, "")  # this process's alone: the processes it starts do not beat for it
    interval, _, path = spec.partition(":")
    if not path:
        return

    def beat() -> None:
        while True:
            try:
                os.utime(path)
            except OSError:  # the supervisor removed it: nobody is watching
                pass
            time.sleep(float(interval))

    _heartbeat[:] = [path]
    threading.Thread(target=beat, name="reinforge-heartbeat", daemon=True).start()


_heartbeat: list[str] = []  # this process's heartbeat file, once it beats


def end_heartbeat(seconds: float) -> None:
    """Tell the supervisor that this process is ending and may take up to `seconds` more (its exit's deadline): the
    interpreter's last teardown runs with no thread left to beat."""
    if _heartbeat:
        try:
            Path(_heartbeat[0]).write_text(f"ending {seconds:g}")
        except OSError:
            pass
