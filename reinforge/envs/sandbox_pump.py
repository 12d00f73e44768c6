"""The caller's side of a sandbox run (`envs/sandbox.py`): feeds the supervisor its job and the program's
stdin, and drains its stdout, stderr and status pipe with `select`, never blocking."""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import signal
import subprocess
import time

KILL_GRACE_S = 5.0  # how long the supervisor may take to empty the sandbox after it is told to


class Pump:
    """Feeds the supervisor's stdin and drains its stdout, stderr and status pipe without blocking."""

    def __init__(self, proc: subprocess.Popen, data: bytes, status_fd: int, max_output_bytes: int) -> None:
        self.proc = proc
        self.data = memoryview(data)
        self.limit = max_output_bytes
        self.stdout, self.stderr, self.status = bytearray(), bytearray(), bytearray()
        self.selector = selectors.DefaultSelector()
        self.pidfd = os.pidfd_open(proc.pid)
        self.buffers = {proc.stdout.fileno(): self.stdout, proc.stderr.fileno(): self.stderr, status_fd: self.status}
        for fd in self.buffers:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ)
        self.stdin_fd = proc.stdin.fileno()
        os.set_blocking(self.stdin_fd, False)
        self.selector.register(self.stdin_fd, selectors.EVENT_WRITE)
        self.selector.register(self.pidfd, selectors.EVENT_READ)
        self.written = 0

    def run(self, deadline: float) -> str | None:
        """Pump until the supervisor exits; the status the caller imposed (timeout, output_limit) or None."""
        stopped, kill_at = None, math.inf
        try:
            while True:
                now = time.monotonic()
                if stopped is None and now >= deadline:
                    stopped, kill_at = "timeout", self._stop()
                if now >= kill_at:  # the supervisor did not empty the sandbox in time
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    kill_at = math.inf
                wake = deadline if stopped is None else kill_at
                for key, _ in self.selector.select(None if wake == math.inf else max(0.0, wake - now)):
                    if key.fd == self.pidfd:
                        self._drain()
                        self.proc.wait()
                        return stopped
                    if key.fd == self.stdin_fd:
                        self._write()
                    else:
                        self._read(key.fd)
                        if stopped is None and self._over_limit():
                            stopped, kill_at = "output_limit", self._stop()
        finally:
            self.selector.close()
            os.close(self.pidfd)

    def _stop(self) -> float:
        """Tell the supervisor to kill the program; returns when to kill the supervisor's group instead."""
        self.proc.send_signal(signal.SIGTERM)
        return time.monotonic() + KILL_GRACE_S

    def _write(self) -> None:
        try:
            self.written += os.write(self.stdin_fd, self.data[self.written : self.written + (1 << 16)])
        except BlockingIOError:
            return
        except BrokenPipeError:  # the program exited without reading all its input
            self.written = len(self.data)
        if self.written == len(self.data):
            self.selector.unregister(self.stdin_fd)
            self.proc.stdin.close()

    def _read(self, fd: int) -> bool:
        """Read what is there; False when nothing more will come now (end of file, or an empty pipe)."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            self.selector.unregister(fd)
            return False
        buffer = self.buffers[fd]
        buffer += chunk[: max(0, self.limit + 1 - len(buffer))]  # one byte over marks the overflow
        return True

    def _over_limit(self) -> bool:
        return len(self.stdout) > self.limit or len(self.stderr) > self.limit

    def _drain(self) -> None:
        """After the supervisor exited: take what is left in the pipes, without waiting for more."""
        for fd, buffer in self.buffers.items():
            while fd in self.selector.get_map() and len(buffer) <= self.limit and self._read(fd):
                pass
        for buffer in (self.stdout, self.stderr):
            del buffer[self.limit :]
