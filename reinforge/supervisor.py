"""Automatic recovery (`cluster.max_restarts`): a run's own process is started and watched by this one, and
restarted from its last complete checkpoint when the machinery failed rather than the input.

`reinforge grpo|ppo|distill|sft|dpo|rm|demo` with `cluster.max_restarts` > 0 runs the same command again in a child
process (the run), passes its output through, and when the run ends:
- exit 0: done;
- exit 75, an `InfrastructureError` (a Ray worker died: a training rank, an engine, the critic, a teacher, an env
  worker; a wait passed its deadline), or death by a signal (the run's process was killed, out of memory or by hand):
  the run is restarted with `checkpoint.resume=auto` in the same run directory. Its worker groups went down with it,
  so the restart builds them afresh and continues from the newest complete checkpoint (or from the start when there is
  none yet), and a synchronous run ends with the metrics of a run never interrupted (resume is exact). Each restart is
  a row of RUN_DIR/restarts.jsonl and one line on stderr, with the cause; past `cluster.max_restarts` restarts the
  command stops with one line and the last failure's exit status;
- any other exit (2: a setting, a path or a file to fix; 130: interrupted) is the command's own, never restarted.
Ctrl-C or SIGTERM sent to this process reach the run and end the command; nothing is restarted after them. The run
dies with this process (Linux: PR_SET_PDEATHSIG), so a killed supervisor never leaves a run writing on its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from reinforge.run_dir import RUN_DIR_FILE_ENV

SUPERVISED_ENV = "REINFORGE_SUPERVISED"  # set in the run's process: it runs the loop itself
INFRASTRUCTURE_EXIT = 75  # EX_TEMPFAIL: the CLI's exit status for an InfrastructureError
RESTARTS_FILE = "restarts.jsonl"


def supervised() -> bool:
    return bool(os.environ.get(SUPERVISED_ENV))


def max_restarts(config_path: str | None, overrides: list[str]) -> int:
    """`cluster.max_restarts` from the config file and the overrides, read without validating the rest (the run
    validates; a file it cannot read gives the default here and the run's own one-line error there)."""
    from reinforge.cluster.config import TrainerClusterConfig
    from reinforge.config.loader import read_yaml_tree

    value = TrainerClusterConfig.model_fields["max_restarts"].default
    try:
        tree = read_yaml_tree(Path(config_path)) if config_path else {}
        value = (tree.get("cluster") or {}).get("max_restarts", value)
    except Exception:  # noqa: BLE001  the run reports a bad file on its own
        pass
    for override in overrides:
        key, _, text = override.partition("=")
        if key.strip() == "cluster.max_restarts":
            value = text.strip()
    try:
        return max(int(value), 0)
    except (TypeError, ValueError):
        return 0  # the run refuses the value with its one line


def _die_with_parent() -> None:
    """In the run's process, before it starts: SIGKILL it when the supervisor dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pass_through(stream, sink, last_error: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.write(line)
        sink.flush()
        if line.startswith("reinforge: error:"):
            last_error[0] = line.removeprefix("reinforge: error:").strip()


def describe_exit(code: int) -> str:
    if code < 0:
        return f"the run's process was killed by {signal.Signals(-code).name}"
    return f"the run exited with status {code}"


class Supervisor:
    def __init__(self, argv: list[str], limit: int):
        self.argv, self.limit = argv, limit
        self.stopping = False  # Ctrl-C or SIGTERM reached this process: end, never restart
        self.child: subprocess.Popen | None = None

    def _attempt(self, argv: list[str], run_dir_file: Path) -> tuple[int, str]:
        env = {**os.environ, SUPERVISED_ENV: "1", RUN_DIR_FILE_ENV: str(run_dir_file)}
        command = [sys.executable, "-m", "reinforge.cli", *argv]
        self.child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        last_error = [""]
        reader = threading.Thread(target=_pass_through, args=(self.child.stderr, sys.stderr, last_error), daemon=True)
        reader.start()
        while True:
            try:
                code = self.child.wait()
                break
            except KeyboardInterrupt:  # the terminal sent SIGINT to the run too; wait for it to end
                self.stopping = True
        reader.join(timeout=5)
        return code, last_error[0]

    def _forward_sigterm(self, signum, frame) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, self._forward_sigterm)
        handle, name = tempfile.mkstemp(prefix="reinforge-run-dir-")
        os.close(handle)
        run_dir_file, argv, restarts = Path(name), list(self.argv), 0
        try:
            while True:
                began = time.time()
                code, error = self._attempt(argv, run_dir_file)
                restartable = code == INFRASTRUCTURE_EXIT or code < 0
                if code == 0 or self.stopping or not restartable:
                    return code if code >= 0 else 128 - code
                cause = error or describe_exit(code)
                run_dir = run_dir_file.read_text().strip() or None
                if restarts == self.limit:
                    print(
                        f"reinforge: error: the run failed {restarts + 1} times, the last time with: {cause}; "
                        f"gave up after cluster.max_restarts={self.limit} restarts",
                        file=sys.stderr,
                    )
                    return code if code > 0 else 128 - code
                restarts += 1
                if run_dir:
                    row = {"restart": restarts, "time": time.time(), "after_s": time.time() - began, "cause": cause}
                    with open(Path(run_dir) / RESTARTS_FILE, "a") as file:
                        file.write(json.dumps(row) + "\n")
                    argv = [*self.argv, "checkpoint.resume=auto", f"logging.run_dir={run_dir}"]
                where = f" in {run_dir}" if run_dir else ""
                print(
                    f"reinforge: restart {restarts} of {self.limit}{where} from the last checkpoint, after: {cause}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            signal.signal(signal.SIGTERM, previous)
            run_dir_file.unlink(missing_ok=True)


def supervise(argv: list[str], limit: int) -> int:
    """Run `reinforge ARGV` in a child process, restarting it up to `limit` times as the module docstring says;
    returns the command's exit status."""
    return Supervisor(argv, limit).run()
