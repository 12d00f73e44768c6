"""Killing a run at a known point, for the resume tests: a recipe's resumed run must end with the metrics of a run
never killed."""

import contextlib
import io
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from reinforge.cli import main


def cli_command(recipe: str, config: str | Path, *args: str) -> list[str]:
    """`python -m reinforge.cli RECIPE --config CONFIG ARGS...`, as a user types it."""
    return [sys.executable, "-m", "reinforge.cli", recipe, "--config", str(config), *args]


def kill_once_step_checkpointed(command: list[str], run_dir, step: int, timeout_s: float = 300) -> None:
    """Start `command` and SIGKILL it as soon as step `step`'s checkpoint in `run_dir` is complete; fail if the
    run ended before that."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
    deadline = time.time() + timeout_s
    while process.poll() is None and not marker.exists() and time.time() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -9, f"the run ended before it could be killed after step {step}"


def json_rows(path: Path) -> list[dict]:
    """A JSONL file's rows, without a last line still being written."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def kill_at_random_moments(command: list[str], run_dir: Path, reference: Path, seed: int, attempts: int = 3) -> int:
    """Start `command` (a run in `run_dir`, resuming) up to `attempts` times, SIGKILLing each at a moment of the run's
    own, not the wall clock's (another test may slow either run): the first in its start-up, once its run directory
    exists; each later one at a random fraction (0-0.5) of the `reference` run's mean step after it logs a step of
    its own (generating ahead, training, a refit or a save). Stops when a run finishes first. Returns the kills: all
    3 of 3 in a run of 6 steps, whatever the machine's load, since an attempt advances at most about two steps. Three
    kills reach the moments that five did (before the first checkpoint, within a step, between steps); each extra
    attempt is another start-up of the run."""
    step_s = sum(rows := [r["timing/step_s"] for r in json_rows(reference / "metrics.jsonl") if "timing/step_s" in r])
    step_s /= max(len(rows), 1)
    rng, kills = random.Random(seed), 0
    for attempt in range(attempts):
        seen = len(json_rows(run_dir / "prompts.jsonl"))
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while process.poll() is None and time.time() < deadline:
            started = (run_dir / "config.yaml").exists()
            if (attempt == 0 and started) or (attempt > 0 and len(json_rows(run_dir / "prompts.jsonl")) > seen):
                break
            time.sleep(0.01)
        try:
            process.wait(timeout=rng.uniform(0.0, 0.5) * step_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            kills += process.wait(timeout=60) == -signal.SIGKILL
        if process.returncode == 0:
            break  # it finished before the moment came
    return kills


def comparable_metrics(run_dir) -> list[dict]:
    """metrics.jsonl without the rows' timings and throughputs (which differ from run to run)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def run_here(command: list[str]) -> subprocess.CompletedProcess:
    """A `cli_command`-style command through cli.main in this process (cluster.max_restarts=0: no supervised child,
    no interpreter start-up; the supervisor's relay is tests/e2e/test_cli.py's), as a finished command."""
    assert command[1:3] == ["-m", "reinforge.cli"], command
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        status = main([*map(str, command[3:]), "cluster.max_restarts=0"])
    return subprocess.CompletedProcess(command, status, out.getvalue(), err.getvalue())


def assert_resumes_like_a_run_never_killed(command_of, tmp_path, step: int) -> list[dict]:
    """Run `command_of(run_dir)` through uninterrupted; run it again, killed once step `step` is checkpointed, and
    resume it with the same command: the metrics must be equal. Returns them. Only the killed run needs a process
    of its own: the other two run in this one."""
    reference, run = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted = run_here(command_of(reference))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    kill_once_step_checkpointed(command_of(run), run, step)
    resumed = run_here(command_of(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{step:08d}" in resumed.stdout
    assert comparable_metrics(run) == comparable_metrics(reference)
    return comparable_metrics(run)


def descendants(pid: int) -> list[int]:
    """Every live descendant of process `pid` (children first, then theirs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found += [int(entry.name), *descendants(int(entry.name))]
    return found


def cmdline(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
