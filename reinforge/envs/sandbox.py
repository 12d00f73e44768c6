"""Run untrusted Python (a model's program) so that, whatever it does, the host and the caller survive.

`run_python(source, limits, stdin)` runs `source` as `main.py` in a fresh interpreter and returns a
`SandboxResult`. Three processes take part:

- the caller's thread starts the *supervisor* (`python -I -S -c _BOOTSTRAP`: an empty environment,
  a session and process group of its own), sends it its code, the job and the program's stdin
  through one pipe, and reads stdout, stderr and a status pipe with `select`, never blocking;
- the supervisor, with the caller's privileges, builds the isolation and forks
- the *program*, which sets its rlimits, drops its privileges and execs `python -I -B main.py`.

Protections, and how each is achieved ("ns": namespace isolation, the default where it works;
"plain": the fallback, see below):

- Runaway CPU: RLIMIT_CPU per process (`cpu_time_s`; SIGXCPU, then SIGKILL a second later).
- Hanging, sleeping, waiting on stdin: `wall_time_s` for the whole run, then every process of the
  sandbox is killed.
- Memory bomb: RLIMIT_AS per process (`memory_mb`); allocations past it raise MemoryError.
- Fork bomb, thread bomb: every run gets a random uid of its own (2^30 to 2^31-1: no account, no
  file), so RLIMIT_NPROC (`max_processes`) counts this run's processes and threads only.
- Leftover processes (daemons, `setsid` escapes): ns: the program lives in a new pid namespace
  whose init is the supervisor's child; when the program's main process exits, or on timeout, the
  init exits and the kernel kills every process of the namespace before the run returns. plain:
  the supervisor kills everything the run's uid owns (`kill(-1, SIGKILL)` as that uid, until /proc
  shows none alive).
- The caller dying mid-run (a crashed actor): PR_SET_PDEATHSIG sends the supervisor SIGTERM, on
  which it empties the sandbox as on a timeout (the namespace's init has PDEATHSIG SIGKILL on the
  supervisor in turn). A timer in the supervisor does the same at `wall_time_s` + 10 s, should the
  caller be alive but stuck.
- Killing the caller (`os.kill(os.getppid())`, `kill -9 -1`): the program's uid may signal only its
  own processes; ns: it does not even see any other.
- Reading the caller's environment: the supervisor and the program start with a scrubbed
  environment (PATH, HOME, TMPDIR, LANG, BLAS thread counts); `/proc/<pid>/environ` of the caller
  and the supervisor are root's, mode 0400; ns: no process outside the sandbox is in the program's
  /proc (a new proc, mounted `hidepid=2`).
- Writing outside the working directory, /tmp included: ns: in a new mount namespace every mount
  is remounted read-only and nosuid, then fresh tmpfs are mounted on /tmp (`workdir_mb`; root's,
  mode 0755, holding the working directory /tmp/work, the only directory the program's uid owns)
  and, empty and read-only, on /dev/shm and /run (a unix socket can be connected to on a read-only
  mount, so daemons' sockets there are hidden; /tmp's are too). The tmpfs vanish with the namespace: the working
  directory is deleted with the run, and nothing written reaches the host. plain: the program's uid owns only
  its working directory (a fresh `mkdtemp`, deleted afterwards), so it can write only there and in
  world-writable directories: **/tmp and /dev/shm stay writable in plain mode**.
- Big files: RLIMIT_FSIZE (`file_size_mb`) per file; ns: the tmpfs size caps the directory.
- File-descriptor exhaustion: RLIMIT_NOFILE (`max_open_files`).
- Network: ns: a new network namespace with no interface up (not even loopback): every connect
  fails. plain: `socket.socket` and friends are replaced by a function raising PermissionError
  before the program runs; a program reaching the kernel another way (ctypes, a subprocess) is not
  stopped.
- Output flood: stdout and stderr are read as they come; past `max_output_bytes` on either, the run
  is stopped (status `output_limit`), keeping what was read.
- setuid binaries: PR_SET_NO_NEW_PRIVS before exec; ns: every mount is nosuid as well.
- Core dumps: RLIMIT_CORE = 0.

Isolation and interpreter are chosen once per process (`isolation="auto"`, `python=""`) by probe
runs: namespaces first (unshare of the mount, pid, network, IPC and UTS namespaces, which needs root,
i.e. CAP_SYS_ADMIN), then plain; the caller's interpreter first, then the system's python3 (an
interpreter inside /root, like a pyenv or a venv there, cannot be executed by an unprivileged uid).
Anything but the first choice logs a warning saying what failed. The uid drop needs root too
(CAP_SETUID): without it the program runs as the caller, with no RLIMIT_NPROC (it would count the
caller's processes) and no uid sweep (only the process group is killed), so plain mode as an
unprivileged user is a weak sandbox, and the warning says so. Needs Linux >= 5.3 (pidfd).

Not covered: the total memory of a run is bounded only by `max_processes` x `memory_mb` (plus the
tmpfs), since no memory cgroup is used; the program can read the host's world-readable files and
connect to world-writable unix sockets outside /tmp, /run and /dev/shm; it can create user
namespaces if the kernel allows unprivileged ones (more kernel surface, no host privilege; set
`user.max_user_namespaces=0` on a dedicated host); there is no seccomp filter and no CPU share.

Cost per run, measured on a 2-core VM (Linux 6.18, Python 3.11; other jobs kept its load at 3 to
10, hence the ranges) as CPU time of the child processes: for `pass`, namespaces 31 to 38 ms (the
supervisor 20 to 25 ms, half of it starting Python and importing ctypes, the rest forks, mounts and
namespaces; the program's interpreter 11 to 13 ms) and 40 to 70 ms of wall time; plain 48 to 60 ms
(the uid sweep scans /proc; the socket hook imports runpy and socket). A HumanEval sample through
`CodeEnv` costs 42 to 49 ms of CPU, and 8 threads score the 164 HumanEval references in 4 to 6 s.
The supervisor's code is compiled once, in the caller, and sent marshalled (compiling it costs
more than starting Python), and it imports neither `json`, `re` nor `signal` (`signal` imports
enum: 6 ms).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import marshal
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.envs.sandbox_supervisor import supervise
from reinforge.errors import ConfigError

logger = logging.getLogger(__name__)

_UID_BASE, _UID_SPAN = 1 << 30, 1 << 30  # a random uid per run, far above any real account
_KILL_GRACE_S = 5.0  # how long the supervisor may take to empty the sandbox after it is told to
_STATUS_ERROR, _STATUS_OK = "error", "ok"
_SETUP_LOCK = threading.Lock()
_PROBE = (
    "import os, socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), 1)\n"
    "except OSError:\n    print('ok', os.getuid())\n"
)


class SandboxLimits(Section):
    cpu_time_s: float = 10.0
    """CPU seconds per process (RLIMIT_CPU, rounded up); past it the process gets SIGXCPU and the
    run counts as a timeout."""
    wall_time_s: float = 10.0
    """Wall-clock seconds for the whole run, interpreter start included; then every process of the
    sandbox is killed and the status is `timeout`."""
    memory_mb: int = 1024
    """Address space per process in MiB (RLIMIT_AS); allocations past it raise MemoryError."""
    file_size_mb: int = 16
    """Largest file a process may write, in MiB (RLIMIT_FSIZE)."""
    workdir_mb: int = 64
    """Size of the tmpfs holding the working directory (namespace isolation only), in MiB."""
    max_processes: int = 16
    """Processes plus threads the run may have at once (RLIMIT_NPROC on the run's own uid; needs root)."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 1 << 20
    """stdout and stderr are each kept up to this many bytes; a run that writes more to either is
    stopped with status `output_limit`."""
    isolation: Literal["auto", "namespaces", "plain"] = "auto"
    """`namespaces`: new mount, pid, network, IPC and UTS namespaces (needs root); `plain`: rlimits,
    uid drop and process-group kill only (/tmp stays writable, see the module doc); `auto`:
    namespaces where a probe run shows they work, else plain with a warning."""
    python: str = ""
    """Interpreter that runs the programs; empty: the one running reinforge if an unprivileged uid
    may run it (one inside /root may not), else the system's python3."""

    @model_validator(mode="after")
    def _check(self) -> "SandboxLimits":
        for name in (
            "cpu_time_s",
            "wall_time_s",
            "memory_mb",
            "file_size_mb",
            "workdir_mb",
            "max_processes",
            "max_open_files",
            "max_output_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")
        if self.python and not os.access(self.python, os.X_OK):
            raise ValueError(
                f"sandbox python={self.python!r} is not an executable file; "
                "give an interpreter's path or leave it empty"
            )
        return self


@dataclass
class SandboxResult:
    """What one run did."""

    status: (
        str  # ok | failed (exit != 0) | timeout (wall/CPU) | killed (signal) | output_limit | error (sandbox failed)
    )
    returncode: int | None  # the program's exit code, -N if signal N killed it, None if the sandbox stopped it
    stdout: str  # at most max_output_bytes, decoded as UTF-8 with replacement characters
    stderr: str  # likewise; a sandbox error is appended here
    wall_s: float  # from starting the supervisor to the end of the run


def run_python(source: str, limits: SandboxLimits, stdin: str = "") -> SandboxResult:
    """Run `source` as `main.py` in a fresh sandbox; see the module doc. Safe to call from many threads."""
    with _SETUP_LOCK:  # one probe, not one per thread
        python, namespaces = _setup(limits.isolation, limits.python)
    return _run(source, limits, stdin, python, namespaces)


@functools.cache
def _setup(isolation: str, python: str) -> tuple[str, bool]:
    """The interpreter and whether to use namespaces, for these settings: the first that a probe
    run accepts, namespaces first, the caller's interpreter first. Probed once per process."""
    interpreters = [python] if python else _default_interpreters()
    modes = {"auto": [True, False], "namespaces": [True], "plain": [False]}[isolation]
    failures = []
    for namespaces in modes:
        for interpreter in interpreters:
            result = _run(_PROBE, SandboxLimits(wall_time_s=30.0), "", interpreter, namespaces)
            if result.status == _STATUS_OK and result.stdout.startswith("ok"):
                if failures:
                    weak = "" if namespaces or os.geteuid() == 0 else " (not root: no uid of its own, no process limit)"
                    logger.warning(
                        "sandbox: using %s with %s isolation%s; failed before: %s",
                        interpreter,
                        "namespace" if namespaces else "plain",
                        weak,
                        "; ".join(failures),
                    )
                return interpreter, namespaces
            failures.append(
                f"{interpreter} with {'namespaces' if namespaces else 'plain isolation'}: {_describe_failure(result)}"
            )
    raise ConfigError(
        f"the sandbox cannot run programs here ({'; '.join(failures)}); namespaces need root, and the "
        "sandbox's python must be an interpreter an unprivileged user may run, e.g. /usr/bin/python3"
    )


def _default_interpreters() -> list[str]:
    """The caller's interpreter, then the system's python3 (a venv under /root is out of reach of
    an unprivileged uid)."""
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return [sys.executable] + ([system] if system and system != sys.executable else [])


def _describe_failure(result: SandboxResult) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return f"status {result.status}: {lines[-1] if lines else 'no output'}"


def _run(source: str, limits: SandboxLimits, stdin: str, python: str, namespaces: bool) -> SandboxResult:
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if os.geteuid() == 0 else None
    host_workdir = None if namespaces else tempfile.mkdtemp(prefix="reinforge-sandbox-")
    job = {
        "source": source,
        "python": python,
        "uid": uid,
        "namespaces": namespaces,
        "workdir": "/tmp/work" if namespaces else host_workdir,
        "workdir_mb": limits.workdir_mb,
        "rlimits": _rlimits(limits, own_uid=uid is not None),
        "caller_pid": os.getpid(),
        "backstop_s": limits.wall_time_s + 2 * _KILL_GRACE_S,
    }
    blob = marshal.dumps((_SUPERVISOR_CODE, job))
    status_read, status_write = os.pipe()
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(status_write)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_write,),
                start_new_session=True,
                env={},
            )
        finally:
            os.close(status_write)
        with proc:  # closes the pipes and waits, whatever happens
            try:
                io = _Pump(proc, b"%d\n" % len(blob) + blob + stdin.encode(), status_read, limits)
                stopped = io.run(start + limits.wall_time_s)
            finally:
                if proc.poll() is None:  # only if pumping failed: take the whole sandbox down
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        os.close(status_read)
        if host_workdir is not None:
            shutil.rmtree(host_workdir, ignore_errors=True)
    return _result(io, stopped, proc.returncode, time.monotonic() - start)


def _result(io: "_Pump", stopped: str | None, supervisor_code: int, wall_s: float) -> SandboxResult:
    stdout, stderr = (bytes(buffer).decode("utf-8", "replace") for buffer in (io.stdout, io.stderr))
    if stopped:
        return SandboxResult(stopped, None, stdout, stderr, wall_s)
    report = _parse_status(io.status)
    if "error" in report or "returncode" not in report:
        error = report.get("error") or f"the supervisor exited with {supervisor_code} and no report"
        return SandboxResult(_STATUS_ERROR, None, stdout, stderr + f"\nsandbox error: {error}\n", wall_s)
    code = int(report["returncode"])
    if code == 0:
        status = _STATUS_OK
    elif code == -signal.SIGXCPU:
        status = "timeout"
    else:
        status = "killed" if code < 0 else "failed"
    return SandboxResult(status, code, stdout, stderr, wall_s)


def _rlimits(limits: SandboxLimits, own_uid: bool) -> list[tuple[str, int, int]]:
    """(RLIMIT name, soft, hard) for the program."""
    mib = 1 << 20
    cpu = math.ceil(limits.cpu_time_s)
    rlimits = [
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        ("RLIMIT_AS", limits.memory_mb * mib, limits.memory_mb * mib),
        ("RLIMIT_FSIZE", limits.file_size_mb * mib, limits.file_size_mb * mib),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]
    if own_uid:  # RLIMIT_NPROC counts every process of the uid: only meaningful for a uid of its own
        rlimits.append(("RLIMIT_NPROC", limits.max_processes, limits.max_processes))
    return rlimits


def _parse_status(raw: bytes) -> dict[str, str]:
    """The supervisor's report: {"returncode": "N"}, or {"error": why} if any of its processes failed."""
    report: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        kind, _, text = line.partition(" ")
        if kind == "error":
            return {"error": text}  # the first error is the cause; what follows are consequences
        report[kind] = text
    return report


class _Pump:
    """Feeds the supervisor's stdin and drains its stdout, stderr and status pipe without blocking."""

    def __init__(self, proc: subprocess.Popen, data: bytes, status_fd: int, limits: SandboxLimits) -> None:
        self.proc = proc
        self.data = memoryview(data)
        self.limit = limits.max_output_bytes
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
        return time.monotonic() + _KILL_GRACE_S

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


# Compiling the supervisor costs more than starting Python, so it is compiled here, once, and sent
# marshalled (the supervisor runs this same interpreter) with the job, ahead of the program's stdin.
_SUPERVISOR_CODE = marshal.dumps(compile(inspect.getsource(supervise), inspect.getsourcefile(supervise), "exec"))
_BOOTSTRAP = """import marshal, os
def read_exactly(size):
    data = b""
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            raise SystemExit("the sandbox job ended early")
        data += chunk
    return data
header = b""
while not header.endswith(b"\\n"):
    header += read_exactly(1)
code, job = marshal.loads(read_exactly(int(header)))
exec(marshal.loads(code))
supervise(job)
"""
