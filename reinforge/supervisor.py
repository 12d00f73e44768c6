"""Automatic recovery (`cluster.max_restarts`): a run's own process is started and watched by this one, and
restarted from its last complete checkpoint when the machinery failed rather than the input or the code.

`reinforge grpo|ppo|distill|sft|dpo|rm|demo` with `cluster.max_restarts` > 0 runs the same command again in a child
process (the run), passes its output through, and when the run ends (`classify`):
- exit 0: done;
- exit 75, a failure a restart can fix (exits.py `restartable`: an `InfrastructureError`, i.e. a Ray worker died or a
  wait passed its deadline; a transient error of the filesystem or the network, ESTALE, ENOSPC, EIO, a connection
  reset, an HTTP 429/5xx), or death by a signal (killed, out of memory, or ended here for missing its heartbeat): the
  run is restarted with `checkpoint.resume=auto` in the same run directory. Its worker groups went down with it, so
  the restart builds them afresh and continues from the newest complete checkpoint (or from the start when there is
  none yet). Each restart is a row of RUN_DIR/restarts.jsonl and one line on stderr, with the cause (the run's last
  error line) and the run's last stderr line;
- any other exit is never restarted: 2 (a setting, a path, a file, non-finite training, or a bug in the code: running
  again would fail the same way), 130 (interrupted), anything else.
The restarts counted against `cluster.max_restarts` are those since the run last progressed
`cluster.restart_budget_renew_steps` steps beyond the furthest step it had reached at a failure (`RestartBudget`; the
progress read from the run directory, `run_progress`); past the budget the command stops with one line and the last
failure's exit status.
The run's process beats a heartbeat file from a thread of its own (exits.py `start_heartbeat`); when no beat comes for
`cluster.heartbeat_timeout_s` (the process is stopped, or wedged in C code holding the GIL, where its own watchdog
cannot run either), this process writes RUN_DIR/hang_report.txt (its process state, every thread's, its Python stacks
by py-spy), kills it and its descendants, and restarts it as above.
Ctrl-C or SIGTERM sent to this process reach the run and end the command; nothing is restarted after them. The run
dies with this process (Linux: PR_SET_PDEATHSIG), so a killed supervisor never leaves a run writing on its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from reinforge.exits import HEARTBEAT_ENV, INFRASTRUCTURE_EXIT
from reinforge.hang import REPORT_NAME, worker_stacks
from reinforge.run_dir import RUN_DIR_FILE_ENV

SUPERVISED_ENV = "REINFORGE_SUPERVISED"  # set in the run's process: it runs the loop itself
RESTARTS_FILE = "restarts.jsonl"
RECORD_WAIT_S = 60.0  # how long a restart waits for its row of restarts.jsonl to be written (a full disk freed)
KILL_WAIT_S = 60.0  # how long a killed run may take to end (a process in an uninterruptible call ends after it)
METRICS_TAIL_BYTES = 1 << 16  # enough for the last rows of metrics.jsonl
PROCESS_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible (disk)", "T": "stopped", "t": "stopped by a "
                  "debugger", "Z": "a zombie", "X": "dead", "I": "idle"}  # fmt: skip


def supervised() -> bool:
    return bool(os.environ.get(SUPERVISED_ENV))


@dataclass(frozen=True)
class Settings:
    """The `cluster.*` settings this process acts on, read before the run validates the rest."""

    max_restarts: int
    renew_steps: int
    heartbeat_timeout_s: float


def settings(config_path: str | None, overrides: list[str]) -> Settings:
    """`cluster.max_restarts`, `restart_budget_renew_steps` and `heartbeat_timeout_s` from the config file and the
    overrides, read without validating the rest (the run validates; a value it refuses gives the default here and
    the run's own one-line error there)."""
    from reinforge.cluster.config import TrainerClusterConfig
    from reinforge.config.loader import read_yaml_tree

    fields = TrainerClusterConfig.model_fields
    names = ("max_restarts", "restart_budget_renew_steps", "heartbeat_timeout_s")
    values = {name: fields[name].default for name in names}
    try:
        cluster = (read_yaml_tree(Path(config_path)) if config_path else {}).get("cluster") or {}
        values.update({name: cluster[name] for name in names if name in cluster})
    except Exception:  # noqa: BLE001  the run reports a bad file on its own
        pass
    for override in overrides:
        key, _, text = override.partition("=")
        if key.strip() in {f"cluster.{name}" for name in names}:
            values[key.strip().removeprefix("cluster.")] = text.strip()

    def typed(name: str, kind: type) -> int | float:
        try:
            value = kind(values[name])
        except (TypeError, ValueError):
            value = -1
        return value if value >= 0 else kind(fields[name].default)  # the run refuses the value with its one line

    timeout = typed("heartbeat_timeout_s", float)
    return Settings(typed("max_restarts", int), typed("restart_budget_renew_steps", int), timeout or 1.0)


def max_restarts(config_path: str | None, overrides: list[str]) -> int:
    return settings(config_path, overrides).max_restarts


def classify(code: int, stopping: bool) -> str:
    """What to do after the run ended with `code` (negative: killed by that signal): "done" (0, or a stop that was
    asked for: Ctrl-C, SIGTERM), "restart" (75, or killed by a signal), "stop" (everything else: 2, 130, 1...)."""
    if code == 0 or stopping:
        return "done"
    return "restart" if code == INFRASTRUCTURE_EXIT or code < 0 else "stop"


@dataclass
class RestartBudget:
    """`cluster.max_restarts` restarts, renewed once the run gets `renew_steps` steps beyond the furthest step it had
    reached at any failure before (a run that fails again where it failed, or before getting that far, spends it)."""

    limit: int
    renew_steps: int
    used: int = 0
    furthest: int | None = None  # the furthest step the run had reached at a failure so far
    renewed: bool = False  # the last `spend` renewed the budget first

    def spend(self, step: int | None) -> bool:
        """A failure with the run at `step` (None: unknown, no progress read): True (and counted) if it is restarted."""
        self.renewed = (
            self.renew_steps > 0
            and step is not None
            and self.furthest is not None
            and step - self.furthest >= self.renew_steps
        )
        if self.renewed:
            self.used = 0
        if step is not None:
            self.furthest = step if self.furthest is None else max(self.furthest, step)
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


def run_progress(run_dir: Path | None) -> int | None:
    """The furthest step the run in `run_dir` has reached: metrics.jsonl's last step or the newest complete
    checkpoint's, whichever is further; None when neither exists yet. Read only; a torn last line is skipped."""
    if run_dir is None:
        return None
    steps = [
        int(path.name.removeprefix("step_"))
        for path in (run_dir / "checkpoints").glob("step_*")
        if path.name.removeprefix("step_").isdigit() and (path / "COMPLETE").exists()
    ]
    try:
        with open(run_dir / "metrics.jsonl", "rb") as file:
            file.seek(max(file.seek(0, os.SEEK_END) - METRICS_TAIL_BYTES, 0))
            lines = file.read().decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        try:
            steps.append(int(json.loads(line)["step"]))
            break
        except (ValueError, KeyError, TypeError):  # torn, NUL-filled or not a step's row
            continue
    return max(steps) if steps else None


def _die_with_parent() -> None:
    """In the run's process, before it starts: SIGKILL it when the supervisor dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pass_through(stream, sink, last: dict[str, str]) -> None:
    """Copy the run's stderr to ours; remember its last error line and its last line."""
    for line in iter(stream.readline, ""):
        sink.write(line)
        sink.flush()
        if line.strip():
            last["line"] = line.strip()
        if line.startswith("reinforge: error:"):
            last["error"] = line.removeprefix("reinforge: error:").strip()


def describe_exit(code: int) -> str:
    if code < 0:
        return f"the run's process was killed by {signal.Signals(-code).name}"
    return f"the run exited with status {code}"


def state_letter(pid: int) -> str:
    """A process's state letter in /proc (R, S, D, T, Z...); "?" when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "?"


def process_state(pid: int) -> str:
    """A process's state as /proc says it ("stopped (T)"), or that it cannot be read."""
    state = state_letter(pid)
    return f"{PROCESS_STATES.get(state, 'unknown')} ({state})"


def exit_grace(heartbeat: Path) -> float:
    """The seconds a run that said it is ending (exits.py `end_heartbeat`) may take beyond the heartbeat's deadline:
    its interpreter's teardown runs with no thread left to beat, and its own exit deadline bounds it."""
    try:
        word, _, seconds = heartbeat.read_text().partition(" ")
        return float(seconds) if word == "ending" else 0.0
    except (OSError, ValueError):
        return 0.0


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(0), [])
        found += children
        queue += children
    return found


def hang_report(pid: int, silent_s: float) -> str:
    """What the on-call engineer needs of a run's process that stopped beating: its state, each thread's (named),
    where the kernel holds it, and its Python stacks by py-spy (read without stopping it: a stopped process too)."""
    lines = [f"== the run's process (pid {pid}): no heartbeat for {silent_s:.0f} s; state {process_state(pid)} =="]
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda path: int(path.name)):
        try:
            name, wchan = (task / "comm").read_text().strip(), (task / "wchan").read_text().strip()
        except OSError:
            continue
        lines.append(f"thread {task.name} {name!r}: {process_state(int(task.name))}, waiting in {wchan or '-'}")
    stacks = worker_stacks({"run": pid})["run"]
    return "\n".join(lines) + f"\n\n== Python stacks (py-spy) ==\n{stacks}\n"


class Supervisor:
    def __init__(self, argv: list[str], config: Settings):
        self.argv, self.config = argv, config
        self.stopping = False  # Ctrl-C or SIGTERM reached this process: end, never restart
        self.child: subprocess.Popen | None = None

    def _attempt(self, argv: list[str], run_dir_file: Path, heartbeat: Path) -> tuple[int, dict[str, str]]:
        interval = min(max(self.config.heartbeat_timeout_s / 8, 0.1), 5.0)
        env = {**os.environ, SUPERVISED_ENV: "1", RUN_DIR_FILE_ENV: str(run_dir_file)}
        env[HEARTBEAT_ENV] = f"{interval:g}:{heartbeat}"
        heartbeat.write_text("")  # not "ending": a new process
        command = [sys.executable, "-m", "reinforge.cli", *argv]
        self.child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        last = {"error": "", "line": ""}
        reader = threading.Thread(target=_pass_through, args=(self.child.stderr, sys.stderr, last), daemon=True)
        reader.start()
        code = self._watch(heartbeat, run_dir_file, last)
        reader.join(timeout=5)
        return code, last

    def _watch(self, heartbeat: Path, run_dir_file: Path, last: dict[str, str]) -> int:
        """Wait for the run to end; end it here when its heartbeat stops for `heartbeat_timeout_s`."""
        timeout = self.config.heartbeat_timeout_s
        poll = min(1.0, timeout / 4)
        seen, changed = heartbeat.stat().st_mtime_ns, time.monotonic()
        previous = changed
        while True:
            try:
                return self.child.wait(timeout=poll)
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:  # the terminal sent SIGINT to the run too; wait for it to end
                self.stopping = True
            now = time.monotonic()
            if now - previous > max(5 * poll, 5.0):  # this process was stopped itself (Ctrl-Z): count afresh
                changed = now
            previous = now
            mtime = heartbeat.stat().st_mtime_ns if heartbeat.exists() else seen
            if mtime != seen:
                seen, changed = mtime, now
            elif now - changed >= timeout + exit_grace(heartbeat) and state_letter(self.child.pid) not in "ZX":
                last["error"] = self._end_silent(now - changed, run_dir_file)
                try:
                    return self.child.wait(timeout=KILL_WAIT_S)
                except subprocess.TimeoutExpired:  # uninterruptible (a dead NFS server): it dies when the call ends
                    last["error"] += f"; it had not ended {KILL_WAIT_S:g} s after SIGKILL (uninterruptible)"
                    return -signal.SIGKILL

    def _end_silent(self, silent_s: float, run_dir_file: Path) -> str:
        """Write the hang report of a run that stopped beating, kill it and its descendants; return the cause."""
        pid, state = self.child.pid, process_state(self.child.pid)
        run_dir = run_dir_file.read_text().strip()
        path = Path(run_dir or tempfile.gettempdir()) / (REPORT_NAME if run_dir else f"reinforge-hang-{pid}.txt")
        victims = descendants(pid)
        try:
            with open(path, "a") as file:  # after any report the run wrote itself before
                file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {hang_report(pid, silent_s)}")
            where = f"; stacks in {path}"
        except OSError as exc:
            where = f"; no hang report ({exc.strerror}: {path})"
        for victim in [pid, *victims]:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:  # gone already
                pass
        return (
            f"the run's process sent no heartbeat for {silent_s:.0f} s (cluster.heartbeat_timeout_s="
            f"{self.config.heartbeat_timeout_s:g}; its state: {state}): killed{where}"
        )

    def _forward_sigterm(self, signum, frame) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, self._forward_sigterm)
        scratch = Path(tempfile.mkdtemp(prefix="reinforge-supervisor-"))
        run_dir_file, heartbeat = scratch / "run_dir", scratch / "heartbeat"
        run_dir_file.touch()
        argv, budget = list(self.argv), RestartBudget(self.config.max_restarts, self.config.renew_steps)
        try:
            while True:
                began = time.time()
                code, last = self._attempt(argv, run_dir_file, heartbeat)
                status = code if code >= 0 else 128 - code
                if classify(code, self.stopping) != "restart":
                    return status
                cause = last["error"] or describe_exit(code)
                run_dir = Path(text) if (text := run_dir_file.read_text().strip()) else None
                step = run_progress(run_dir)
                if not budget.spend(step):
                    print(
                        f"reinforge: error: the run failed {budget.used + 1} times, the last time with: {cause}; "
                        f"gave up after cluster.max_restarts={budget.limit} restarts",
                        file=sys.stderr,
                    )
                    return status
                renewed = f" (renewed: {budget.renew_steps} steps past the last failure)" if budget.renewed else ""
                if run_dir:
                    row = {"restart": budget.used, "time": time.time(), "after_s": time.time() - began,
                           "cause": cause, "exit": code, "last_line": last["line"], "step": step,
                           "renewed": budget.renewed}  # fmt: skip
                    record_restart(run_dir / RESTARTS_FILE, row)
                    argv = [*self.argv, "checkpoint.resume=auto", f"logging.run_dir={run_dir}"]
                where = f" in {run_dir}" if run_dir else ""
                print(
                    f"reinforge: restart {budget.used} of {budget.limit}{renewed}{where} from the last checkpoint, "
                    f"after: {cause}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(scratch, ignore_errors=True)


def supervise(argv: list[str], config: Settings) -> int:
    """Run `reinforge ARGV` in a child process, restarting it as the module docstring says; returns the command's
    exit status."""
    return Supervisor(argv, config).run()


def record_restart(path: Path, row: dict) -> None:
    """Append `row` to restarts.jsonl. The filesystem may be what failed the run (a full disk, a stale handle): the
    supervisor then waits up to RECORD_WAIT_S for the write to succeed, since a restart into a full disk would fail
    again at once, and if it never does it says so on stderr with the row and restarts anyway (its budget bounds it)."""
    waited, pause = 0.0, 1.0
    while True:
        try:
            with open(path, "a") as file:
                file.write(json.dumps(row) + "\n")
            return
        except OSError as error:
            if waited >= RECORD_WAIT_S:
                print(f"reinforge: cannot write {path} ({error}); its row: {json.dumps(row)}", file=sys.stderr)
                return
            time.sleep(pause)
            waited, pause = waited + pause, min(pause * 2, 8.0)
