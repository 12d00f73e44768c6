"""Killing a run at a known point, for the resume tests: a recipe's resumed run must end with the metrics of a run
never killed."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path


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


def comparable_metrics(run_dir) -> list[dict]:
    """metrics.jsonl without the rows' timings and throughputs (which differ from run to run)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def assert_resumes_like_a_run_never_killed(command_of, tmp_path, step: int) -> list[dict]:
    """Run `command_of(run_dir)` through uninterrupted; run it again, killed once step `step` is checkpointed, and
    resume it with the same command: the metrics must be equal. Returns them."""
    reference, run = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted = subprocess.run(command_of(reference), capture_output=True, text=True, timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    kill_once_step_checkpointed(command_of(run), run, step)
    resumed = subprocess.run(command_of(run), capture_output=True, text=True, timeout=600)
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
