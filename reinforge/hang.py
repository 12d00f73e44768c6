"""Deadlines on a run's waits, hang reports, and the step watchdog.

Every blocking wait of an RL run has a deadline from config (docs/reliability.md "Deadlines" lists them all). A
wait that runs past its deadline raises a `HangError`, whose one line names the component, what it waited for and
for how long, and the setting to change. The stacks of every thread of the driver and, through py-spy where it is
installed, of every Ray worker of the run are taken when the error is raised (`HangError.capture`), while the
workers still exist; `hang_reports` writes them to RUN_DIR/hang_report.txt before the run's workers are released.

The `Watchdog` covers what no single deadline does: the loop beats it at each phase of a step; when no beat comes for
`deadlines.step_s`, it writes the report, raises its `HangError` in the main thread (through a signal, so a wait in
the main thread is interrupted), and if the run has still not stopped GRACE_S later, ends the process with the exit
status of an infrastructure failure (EXIT_STATUS, which a supervised run restarts after).

The run's cleanup (its `BoundedExitStack`: executor shutdowns, the worker groups, `ray.shutdown`; then what the
interpreter waits for at exit) has a deadline too, `deadlines.cleanup_s` (`bound_exit`): a cleanup that runs past it
is reported (its stacks appended to the hang report) and the process ends anyway, with the status it was ending with.
The lines a run prints on its way out (exits.py `console_line`) reach the console, or the supervisor's pipe, even while
fd 2 is the run's log file.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from pydantic import Field

from reinforge.config.section import Section
from reinforge.errors import InfrastructureError
from reinforge.exits import INFRASTRUCTURE_EXIT, console_line, exit_status
from reinforge.run_dir import announced_run_dir

GRACE_S = 30.0  # after the watchdog's signal, how long the run has to stop on its own before the process is ended
EXIT_STATUS = INFRASTRUCTURE_EXIT  # EX_TEMPFAIL, as the CLI's for an InfrastructureError
CLEANUP_S = 120.0  # deadlines.cleanup_s's default
PY_SPY_TIMEOUT_S = 20.0  # for all the workers' dumps together
REPORT_NAME = "hang_report.txt"
T = TypeVar("T")


class TrainerDeadlinesConfig(Section):
    """`deadlines:` of a run with no generation engine (SFT, DPO, RM): its checkpoints and the step watchdog. The
    deadlines of the waits inside a component sit in its section: `cluster.worker_timeout_s`,
    `training.collective_timeout_s`."""

    checkpoint_s: float = Field(default=1800.0, gt=0)
    """The longest writing one checkpoint may take (the weights, the optimizer, the loop's state)."""
    step_s: float = Field(default=3600.0, ge=0)
    """The watchdog: a run in which no phase of a step (rollout, training, refit, validation, checkpoint) finishes
    for this long is stopped; 0: no watchdog."""
    cleanup_s: float = Field(default=CLEANUP_S, gt=0)
    """Once the steps are over (done, failed or stopped by the watchdog): the longest the run's cleanup may take
    (executor shutdowns, the worker groups, Ray, the process's exit); past it the process ends anyway, with one line
    and the cleanup's stacks appended to RUN_DIR/hang_report.txt."""


class DeadlinesConfig(TrainerDeadlinesConfig):
    """`deadlines:` the RL loop's own waits: the trainer's, and the rollouts'. The deadlines of the waits inside a
    component sit in its section: `cluster.worker_timeout_s`, `training.collective_timeout_s`, `agent.timeout_s`,
    `agent.endpoint.request_timeout_s`, `env.remote.*.timeout_s`."""

    rollout_wait_s: float = Field(default=1800.0, gt=0)
    """Async generation: the longest the trainer waits for the rollout producer (a batch, or the engine's turn)."""
    startup_s: float = Field(default=3600.0, ge=0)
    """The start-up watchdog: the longest one phase of start-up may take (loading a model, starting the engines, a
    chunk of the curriculum's pre-filter, the resume and its refit, the start-up probe); 0: none."""


class HangError(InfrastructureError):
    """A wait that ran past its deadline. `stacks`: the threads' and workers' stacks taken by `capture`;
    `report`: the file they were written to, once written (the message then names it)."""

    def __init__(self, component: str, what: str, seconds: float, setting: str):
        super().__init__(component, what, seconds, setting)  # the args, so that it pickles (Ray carries errors)
        self.component, self.what, self.seconds, self.setting = component, what, seconds, setting
        self.stacks = ""
        self.report: Path | None = None

    def __str__(self) -> str:
        line = f"{self.component}: waited {self.seconds:g} s for {self.what} ({self.setting}={self.seconds:g})"
        return line + (f"; stacks in {self.report}" if self.report else "")

    def capture(self, worker_pids: dict[str, int] | None = None) -> HangError:
        """Take the stacks now: this process's threads, and the workers' (`worker_pids`, by default every
        registered one)."""
        self.stacks = stacks_text(registered_workers() if worker_pids is None else worker_pids)
        return self


_workers: dict[str, int] = {}  # name -> pid of the Ray workers alive in this process's run (cluster/ registers them)
_workers_lock = threading.Lock()


def register_workers(pids: dict[str, int]) -> None:
    with _workers_lock:
        _workers.update(pids)


def unregister_workers(names: list[str]) -> None:
    with _workers_lock:
        for name in names:
            _workers.pop(name, None)


def registered_workers() -> dict[str, int]:
    with _workers_lock:
        return dict(_workers)


def thread_stacks() -> str:
    """Every thread of this process, named, with its stack (the innermost call last)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread {ident} "{names.get(ident, "?")}":\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def worker_stacks(pids: dict[str, int]) -> dict[str, str]:
    """Each worker's Python stacks by py-spy (`py-spy dump --nonblocking`: a stopped process is read as it is), or
    why there are none (py-spy missing, the process gone or on another machine)."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if not pids:
        return {}
    if py_spy is None:
        return dict.fromkeys(pids, "(no stacks: py-spy is not installed; pip install py-spy)")
    dumps = {
        name: subprocess.Popen(
            [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, pid in pids.items()
    }
    deadline, stacks = time.monotonic() + PY_SPY_TIMEOUT_S, {}
    for name, process in dumps.items():
        try:
            output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            stacks[name] = output if process.returncode == 0 else f"(no stacks: py-spy said: {output.strip()[-300:]})"
        except subprocess.TimeoutExpired:
            process.kill()
            stacks[name] = f"(no stacks: py-spy did not answer within {PY_SPY_TIMEOUT_S:g} s)"
    return stacks


def stacks_text(pids: dict[str, int]) -> str:
    text = f"== driver (pid {os.getpid()}): every thread ==\n{thread_stacks()}\n"
    for name, stack in worker_stacks(pids).items():
        text += f"\n== Ray worker {name} (pid {pids[name]}) ==\n{stack}\n"
    return text


def write_hang_report(path: Path, error: HangError) -> Path:
    """Write `error`'s line and its stacks (taken now if `capture` was not called) to `path`; the error names it."""
    stacks = error.stacks or stacks_text(registered_workers())
    path.write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {error}\n\n{stacks}")
    error.report = path
    return path


@contextmanager
def hang_reports(run_dir: Path) -> Iterator[None]:
    """Write RUN_DIR/hang_report.txt for a `HangError` raised inside (unless it was written already), re-raise it."""
    try:
        yield
    except HangError as error:
        if error.report is None:
            write_hang_report(run_dir / REPORT_NAME, error)
        raise


def run_with_deadline(fn: Callable[[], T], seconds: float, component: str, what: str, setting: str) -> T:
    """`fn()`, on a thread of its own so that this thread stops waiting for it after `seconds` (a `HangError`; `fn`
    is abandoned, it runs on a daemon thread); its exception if it raises."""
    result: Future = Future()

    def target() -> None:
        try:
            result.set_result(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            result.set_exception(exc)

    threading.Thread(target=target, name=f"reinforge-{component}", daemon=True).start()
    try:
        return result.result(timeout=seconds)
    except TimeoutError:
        raise HangError(component, what, seconds, setting).capture() from None


class Watchdog:
    """Stops a run in which nothing makes progress for `seconds`: see the module's docstring. A context manager;
    `beat(what)` after every phase that finished (`what`: the one that starts, named in the error)."""

    def __init__(self, seconds: float, report_path: Path, setting: str = "deadlines.step_s", grace_s: float = GRACE_S):
        self.seconds, self.report_path, self.setting, self.grace_s = seconds, report_path, setting, grace_s
        self.error: HangError | None = None
        self._last_beat, self._what = time.monotonic(), "the first step"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="reinforge-watchdog", daemon=True)
        self._main = threading.main_thread()
        self._old_handler: Any = None

    def beat(self, what: str) -> None:
        self._last_beat, self._what = time.monotonic(), what

    def __enter__(self) -> Watchdog:
        if not self.seconds:
            return self
        if threading.current_thread() is self._main:  # only the main thread may set a signal handler
            self._old_handler = signal.signal(signal.SIGUSR1, self._raise)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopped.set()
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR1, self._old_handler)

    def _raise(self, signum, frame) -> None:
        if self.error is not None and not self._stopped.is_set():
            raise self.error

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.seconds / 4)):
            if time.monotonic() - self._last_beat >= self.seconds:
                break
        if self._stopped.is_set():
            return
        error = HangError("watchdog", f"{self._what} to make progress", self.seconds, self.setting).capture()
        write_hang_report(self.report_path, error)
        self.error = error
        if self._old_handler is not None:
            signal.pthread_kill(self._main.ident, signal.SIGUSR1)
        if not self._stopped.wait(self.grace_s):
            console_line(f"reinforge: error: {error} (the run did not stop within {self.grace_s:g} s: ended)")
            os._exit(EXIT_STATUS)


class _ExitDeadline:
    """The deadline of a process's end (`bound_exit`); off until the CLI, the process's entry, turns it on."""

    enabled = False
    status, report, error, seconds = 0, None, "", CLEANUP_S
    thread: threading.Thread | None = None
    generation = 0  # bumped by `cancel_exit_deadline`: a deadline of an earlier generation does nothing
    lock = threading.Lock()


def enable_exit_deadline() -> None:
    """Let `bound_exit` end this process: only a process whose entry is the CLI (a test calling a loop keeps its)."""
    _ExitDeadline.enabled = True


def bound_exit(
    seconds: float | None, status: int | None = None, report: Path | None = None, error: str | None = None
) -> None:
    """From the first call on, this process has `seconds` to end (None: the last run's `deadlines.cleanup_s`); past
    them it appends every thread's stack to `report` (the hang report), prints one line naming `error` (what it was
    ending with) and ends with `status`. Later calls update the status, report and error, not the deadline. Nothing
    unless `enable_exit_deadline`."""
    if not _ExitDeadline.enabled:
        return
    with _ExitDeadline.lock:
        seconds = _ExitDeadline.seconds = seconds or _ExitDeadline.seconds
        if status is not None:
            _ExitDeadline.status = status
        _ExitDeadline.report = report or _ExitDeadline.report
        _ExitDeadline.error = error or _ExitDeadline.error
        if _ExitDeadline.thread is None:
            _ExitDeadline.thread = threading.Thread(
                target=_end_late, args=(seconds, _ExitDeadline.generation), name="reinforge-exit-deadline", daemon=True
            )
            _ExitDeadline.thread.start()


def exit_deadline_s() -> float:
    """The seconds `bound_exit` gives this process's end: the last run's `deadlines.cleanup_s`, or its default."""
    return _ExitDeadline.seconds


class BoundedExitStack(ExitStack):
    """A run's ExitStack, whose unwinding (the run's cleanup: executor shutdowns, the worker groups, `ray.shutdown`)
    has a deadline, `seconds` (`deadlines.cleanup_s`): `bound_exit` armed as the unwinding starts, whether the run
    ended, failed or was stopped by the watchdog, and cancelled once it ends in time with nothing raised (a recipe's
    next stage runs on). Past it, the process ends (a CLI's process only, `enable_exit_deadline`)."""

    def __init__(self, seconds: float = CLEANUP_S):
        super().__init__()
        self.seconds = seconds

    def __exit__(self, exc_type, exc, traceback) -> bool:
        bound_exit(self.seconds, exit_status(exc), None, f"{exc}" if exc is not None else "")
        suppressed = super().__exit__(exc_type, exc, traceback)
        if exc is None:
            cancel_exit_deadline()
        return suppressed


def cancel_exit_deadline() -> None:
    """The cleanup that `bound_exit` bounded has ended and the process goes on (the next stage of a recipe)."""
    with _ExitDeadline.lock:
        _ExitDeadline.generation += 1
        _ExitDeadline.thread, _ExitDeadline.status, _ExitDeadline.error = None, 0, ""


def _end_late(seconds: float, generation: int) -> None:
    time.sleep(seconds)
    if generation != _ExitDeadline.generation:
        return
    late = f"the run's cleanup did not finish within {seconds:g} s (deadlines.cleanup_s): ended"
    run_dir = announced_run_dir()
    report = _ExitDeadline.report or (run_dir / REPORT_NAME if run_dir else None)
    if report is not None:
        try:
            with open(report, "a") as file:
                file.write(f"\n{time.strftime('%Y-%m-%d %H:%M:%S')} {late}\n\n{thread_stacks()}")
            late += f"; stacks in {report}"
        except OSError:
            pass
    status = _ExitDeadline.status
    kind = "error" if status else "warning"
    error = f"{_ExitDeadline.error}; then " if _ExitDeadline.error else ""
    console_line(f"reinforge: {kind}: {error}{late}")
    os._exit(status)
