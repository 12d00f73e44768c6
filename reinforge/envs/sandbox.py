"""Run untrusted Python (a model's program) so that, whatever it does, the host and the caller survive.

`run_python(source, limits, stdin)` runs `source` as `main.py` in a fresh interpreter and returns a
`SandboxResult`. Three processes take part: the caller's thread starts the *supervisor* (`python -I -S
-c BOOTSTRAP`: an empty environment, a session of its own) and pumps its pipes with `select`; the
supervisor (`sandbox_supervisor.py`, with the caller's privileges) builds the isolation and forks the
*program*, which sets its rlimits, drops its privileges and execs `python -I -B main.py`.

The sandbox fails closed. `isolation` (see `SandboxLimits`) is one of

- `namespaces` (the default): new mount, pid, network, IPC and UTS namespaces. As root with
  CAP_SYS_ADMIN the program runs as a random uid of its own (2^30 and up); otherwise (a non-root
  trainer, or root in a container without CAP_SYS_ADMIN) the namespaces are made under a new *user*
  namespace, which needs no privilege where the kernel allows unprivileged user namespaces. Where
  neither works, `check_sandbox_available` (called at start-up, before the run directory) and every
  run raise one line saying what failed; nothing ever falls back to plain on its own.
- `user_namespaces`: only the user-namespace variant.
- `plain`: no namespaces, asked for explicitly: rlimits, a random uid when the caller is root, and a
  process-group or uid kill. Without root the program runs as the trainer's uid: it can read the
  trainer's files and `/proc/<pid>/environ`, signal its processes, and reach the network through a
  subprocess or ctypes (only `socket` is taken away). docs/environments.md lists every protection.

Isolated, the program sees only its namespace's processes, has no network interface, writes only its
private /tmp and /dev/shm (tmpfs gone with the namespace), finds the rest read-only (the trainer's home
hidden when it keeps the trainer's uid), and whatever it leaves behind dies with the namespace's init.
Memory: RLIMIT_AS per process (a MemoryError: the program's failure), and with `memory_cgroup` a cgroup
for the whole run (a kill there: `memory_limit`, the program's); a program that fails while the kernel's
OOM killer ran elsewhere (`/proc/vmstat` oom_kill rose) is a sandbox error, the host's shortage, never 0.
docs/environments.md, "The sandbox", lists every protection, per mode, and its test.

Isolation and interpreter are chosen once per process by probe runs, which also check that the
caller's /proc entry is out of sight: root's namespaces, then user namespaces; the caller's
interpreter, then the system's python3 (one under /root, or under a home directory that a user
namespace hides, cannot be run by the program's uid). Needs Linux >= 5.3 (pidfd); RLIMIT_NPROC counts
a user namespace's own processes only from Linux 5.14.

Cost per run (2-core VM, Linux 6.18, Python 3.11) as the children's CPU time, for `pass`: namespaces 31 to
38 ms (40 to 70 ms of wall time), plain 48 to 60 ms; a HumanEval sample through `CodeEnv` 42 to 49 ms.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import marshal
import math
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import field_validator, model_validator

from reinforge.config.section import Section
from reinforge.envs import sandbox_cgroup
from reinforge.envs.sandbox_pump import KILL_GRACE_S, Pump
from reinforge.envs.sandbox_supervisor import BOOTSTRAP, SUPERVISOR_CODE
from reinforge.errors import ConfigError

logger = logging.getLogger(__name__)

_UID_BASE, _UID_SPAN = 1 << 30, 1 << 30  # a random uid per run, far above any real account
_STATUS_ERROR, _STATUS_OK = "error", "ok"
_SETUP_LOCK = threading.Lock()
_PROBE = (  # no network, and (isolated) no sight of the caller: prints ok, the uid, whether the caller is visible
    "import os, socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), 1)\n"
    "except OSError:\n    print('ok', os.getuid(), os.path.exists('/proc/{caller}'))\n"
)
_MODES = {"namespaces": ["namespaces", "user_namespaces"], "user_namespaces": ["user_namespaces"], "plain": ["plain"]}
_HOST_OOM = "the host's out-of-memory killer killed the program (the machine or the trainer's cgroup ran short)"


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
    isolation: Literal["namespaces", "user_namespaces", "plain"] = "namespaces"
    """`namespaces`: the program gets mount, pid, network, IPC and UTS namespaces of its own (as root, and a
    random uid; otherwise under a user namespace); where none can be made, the run refuses to start.
    `user_namespaces`: only the unprivileged variant. `plain`: no isolation, only rlimits and a process
    kill; the program can read what the trainer reads (its environment too, unless root), signal its
    processes and reach the network through a subprocess (see envs/sandbox.py)."""
    memory_cgroup: str = ""
    """A cgroup v2 directory with `memory` in its cgroup.subtree_control that the trainer may write (see
    envs/sandbox_cgroup.py): each run then gets a child cgroup, and `memory_mb` bounds the whole run (its
    processes and its tmpfs), not only each process; a program the kernel kills there exceeded its own limit
    (status `memory_limit`). Empty: rlimits only. Checked at start-up."""
    python: str = ""
    """Interpreter that runs the programs; empty: the one running reinforge if an unprivileged uid
    may run it (one inside /root may not), else the system's python3."""

    @field_validator("isolation", mode="before")
    @classmethod
    def _no_auto(cls, value: object) -> object:
        if value == "auto":
            raise ValueError(
                "sandbox isolation=auto is gone (it fell back to plain isolation with only a log warning): use "
                "namespaces, the default, which refuses to run without isolation, or plain, to run without it"
            )
        return value

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
    python, mode = _chosen(limits)
    return _run(source, limits, stdin, python, mode)


def check_sandbox_available(limits: SandboxLimits, key: str = "sandbox") -> str:
    """One line at start-up (a ConfigError) when programs cannot run with the isolation `limits` asks
    for; else the isolation chosen. `key` names the settings in the message (`env.code.sandbox`)."""
    return _chosen(limits, key)[1]


def _chosen(limits: SandboxLimits, key: str = "sandbox") -> tuple[str, str]:
    with _SETUP_LOCK:  # one probe, not one per thread
        try:
            return _setup(limits.isolation, limits.python, limits.memory_cgroup)
        except _Unavailable as exc:
            advice = (_INTERPRETER if limits.isolation == "plain" else _ALLOW_PLAIN + _INTERPRETER).format(key=key)
            how = "" if limits.isolation == "plain" else "isolated "
            raise ConfigError(f"{key}: model-written programs cannot run {how}here ({exc}); {advice}") from None


class _Unavailable(Exception):  # no probe run succeeded; the message lists each attempt and why it failed
    pass


@functools.cache
def _setup(isolation: str, python: str, memory_cgroup: str) -> tuple[str, str]:
    """The interpreter and the isolation mode for these settings: the first that a probe run accepts,
    root's namespaces first, the caller's interpreter first. Probed once per process."""
    interpreters = [python] if python else _default_interpreters()
    failures = []
    for mode in _MODES[isolation]:
        for interpreter in interpreters:
            probe = SandboxLimits(wall_time_s=30.0, memory_cgroup=memory_cgroup)
            result = _run(_PROBE.format(caller=os.getpid()), probe, "", interpreter, mode)
            words = result.stdout.split()
            if result.status == _STATUS_OK and words[:1] == ["ok"] and (mode == "plain" or words[2:] == ["False"]):
                if mode == "plain":
                    logger.warning("sandbox: plain isolation, as configured: %s", _PLAIN_GAPS)
                elif failures:
                    logger.info("sandbox: %s with %s; before: %s", interpreter, mode, "; ".join(failures))
                return interpreter, mode
            visible = result.status == _STATUS_OK and words[:1] == ["ok"]
            why = "the caller's process is visible to the program" if visible else _describe_failure(result)
            failures.append(f"{interpreter} with {mode}: {why}")
    raise _Unavailable("; ".join(failures))


_PLAIN_GAPS = "programs are not isolated: without root they run as the trainer's uid, so they can read its files and \
its processes' environments, signal them, and reach the network through a subprocess"
_INTERPRETER = (
    "the programs' interpreter ({key}.python) must be one the program's uid can run: not under /root, nor, "
    "with user namespaces, under the trainer's home (which they hide), e.g. /usr/bin/python3"
)
_ALLOW_PLAIN = (
    "namespaces need root (CAP_SYS_ADMIN) or unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
    "and kernel.apparmor_restrict_unprivileged_userns=0 where that exists); to run them without isolation, set "
    "{key}.isolation=plain: " + _PLAIN_GAPS + "; "
)


def _default_interpreters() -> list[str]:
    """The caller's interpreter, then the system's python3 (one under /root is out of an unprivileged uid's reach)."""
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return [sys.executable] + ([system] if system and system != sys.executable else [])


def _describe_failure(result: SandboxResult) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return f"status {result.status}: {lines[-1] if lines else 'no output'}"


def _hidden_directories(mode: str) -> list[str]:
    """What a user namespace hides from a program that keeps the caller's uid: the caller's home."""
    if mode != "user_namespaces" or os.geteuid() == 0:
        return []
    homes = {os.environ.get("HOME", "")}
    with contextlib.suppress(KeyError):  # a uid with no account (a container's arbitrary uid) has no entry
        homes.add(pwd.getpwuid(os.geteuid()).pw_dir)
    homes = {os.path.realpath(home) for home in homes if os.path.isabs(home)}
    return sorted(homes - {"/", "/tmp"})


def _oom_kills() -> int:
    """How many processes the kernel's out-of-memory killer has killed since boot (-1: unknown)."""
    try:
        with open("/proc/vmstat") as vmstat:
            return next((int(line.split()[1]) for line in vmstat if line.startswith("oom_kill ")), -1)
    except OSError:
        return -1


def _run(source: str, limits: SandboxLimits, stdin: str, python: str, mode: str) -> SandboxResult:
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if os.geteuid() == 0 else None
    try:
        cgroup = limits.memory_cgroup and sandbox_cgroup.create(limits)
    except OSError as exc:  # the probe meets this first: one line at start-up
        return SandboxResult(_STATUS_ERROR, None, "", f"sandbox error: the run's cgroup: {exc!r}\n", 0.0)
    host_workdir = tempfile.mkdtemp(prefix="reinforge-sandbox-") if mode == "plain" else None
    job = {
        "cgroup": cgroup,
        "source": source,
        "python": python,
        "uid": uid,
        "mode": mode,
        "hide": _hidden_directories(mode),
        "workdir": host_workdir or "/tmp/work",
        "workdir_mb": limits.workdir_mb,
        # RLIMIT_NPROC counts every process of the uid: meaningful for a uid of its own, or per user namespace
        "rlimits": _rlimits(limits, own_uid=uid is not None or mode == "user_namespaces"),
        "caller_pid": os.getpid(),
        "backstop_s": limits.wall_time_s + 2 * KILL_GRACE_S,
    }
    blob = marshal.dumps((SUPERVISOR_CODE, job))
    status_read, status_write = os.pipe()
    start, oom_before = time.monotonic(), _oom_kills()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BOOTSTRAP, str(status_write)],
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
                io = Pump(proc, b"%d\n" % len(blob) + blob + stdin.encode(), status_read, limits.max_output_bytes)
                stopped = io.run(start + limits.wall_time_s)
            finally:
                if proc.poll() is None:  # only if pumping failed: take the whole sandbox down
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        os.close(status_read)
        if host_workdir is not None:
            shutil.rmtree(host_workdir, ignore_errors=True)
        own_oom = bool(cgroup) and sandbox_cgroup.oom_kills(cgroup) > 0
        if cgroup:
            sandbox_cgroup.remove(cgroup)
    host_oom = not own_oom and oom_before >= 0 and _oom_kills() > oom_before
    return _result(io, stopped, proc.returncode, time.monotonic() - start, "memory_limit" if own_oom else host_oom)


def _result(io: Pump, stopped: str | None, supervisor_code: int, wall_s: float, oom: bool | str) -> SandboxResult:
    """The verdict. `oom`: "memory_limit" when the kernel killed in the run's own cgroup, else whether the
    kernel's OOM killer ran during the run (the host's shortage, see `_verdict`)."""
    stdout, stderr = (bytes(buffer).decode("utf-8", "replace") for buffer in (io.stdout, io.stderr))
    if stopped:
        return SandboxResult(stopped, None, stdout, stderr, wall_s)
    report = _parse_status(io.status)
    if "error" in report or "returncode" not in report:
        error = report.get("error") or f"the supervisor exited with {supervisor_code} and no report"
        return SandboxResult(_STATUS_ERROR, None, stdout, stderr + f"\nsandbox error: {error}\n", wall_s)
    code = int(report["returncode"])
    status = _verdict(code, oom)
    if status == _STATUS_ERROR:
        stderr += f"\nsandbox error: {_HOST_OOM}\n"
    return SandboxResult(status, code, stdout, stderr, wall_s)


def _verdict(code: int, oom: bool | str) -> str:
    """The status of a program that exited with `code`. `oom` True: the kernel's OOM killer ran during the
    run, not in the run's own cgroup, so the host ran short (RLIMIT_AS turns the program's own excess into a
    MemoryError first): no verdict, a sandbox error. "memory_limit": it killed in the run's own cgroup."""
    if code != 0 and oom:
        return "memory_limit" if oom == "memory_limit" else _STATUS_ERROR
    if code == 0:
        return _STATUS_OK
    if code == -signal.SIGXCPU:
        return "timeout"
    return "killed" if code < 0 else "failed"


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
