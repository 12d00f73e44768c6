"""A run whose Ray worker stops answering (SIGSTOP: alive, but never running again) ends within its deadline with
one line naming the component, what it waited for and the setting, after writing RUN_DIR/hang_report.txt with the
driver's threads and, by py-spy, the stopped worker's own stack. A stopped training rank noticed by its heartbeat
(cluster.heartbeat_timeout_s), named as stopped, and the supervised run recovering from it with the default restart
budget: tests/e2e/test_restarts.py, in one run with a killed rank. Real GRPO runs on the demo model."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from test_fsdp2_grpo import ancestors, worker_pids

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

ARGS = [
    "loop.max_steps=200",
    "loop.val_every=0",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=16",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
    "cluster.max_restarts=0",  # the run's own line, not the supervisor's restart
]


def stop_a_worker_once_stepping(
    tmp_path, pattern: str, *overrides, args=tuple(ARGS)
) -> tuple[subprocess.CompletedProcess, float, str]:
    """Start the run; once it logged a step, SIGSTOP one of its Ray workers named `pattern`; return how the run
    ended, how long after the stop its hang report was written, and the stopped worker's name."""
    run_dir = tmp_path / "run"
    config = str(PROJECT_ROOT / "configs" / "grpo_demo.yaml")
    command = [sys.executable, "-m", "reinforge.cli", "grpo", "--config", config, *args, *overrides,
               f"logging.run_dir={run_dir}"]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while run.poll() is None and time.time() < deadline and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.2)
    victims = [pid for pid in worker_pids(pattern) if run.pid in ancestors(pid)]  # this run's, no other test's
    assert victims, f"no {pattern} worker of this run: {run.poll()}"
    os.kill(victims[-1], signal.SIGSTOP)
    stopped_at = time.time()
    try:
        stdout, stderr = run.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone once the run ended; if not, so that it can be killed
            os.kill(victims[-1], signal.SIGCONT)
        run.kill()
    assert (run_dir / "hang_report.txt").is_file(), stderr[-3000:]
    seconds, victim = read_hang_report(run_dir, victims[-1], stopped_at)
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr), seconds, victim


def read_hang_report(run_dir, pid: int, stopped_at: float) -> tuple[float, str]:
    """Check RUN_DIR/hang_report.txt: the stopped Ray worker `pid`'s own stack (py-spy's), the driver's threads;
    return how long after `stopped_at` it was written and the worker's name."""
    report = run_dir / "hang_report.txt"
    text = report.read_text()
    assert f"(pid {pid}) ==" in text, text[-3000:]
    before, after = text.split(f" (pid {pid}) ==", 1)
    victim, victim_stack = before.rsplit("== Ray worker ", 1)[1], after.split("\n== ", 1)[0]
    assert "Thread" in victim_stack and "(no stacks" not in victim_stack, victim_stack  # py-spy read the stopped one
    assert '"MainThread"' in text and '"reinforge-watchdog"' in text
    return report.stat().st_mtime - stopped_at, victim


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 75, result.stderr[-3000:]  # an infrastructure failure: restartable
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_a_stopped_engine_under_async_rollouts_ends_the_run_at_the_rollout_deadline(tmp_path):
    """The trainer waits 4 s for the batch that the stopped engine never makes; the producer thread, blocked in the
    engine call, gives up at the worker timeout (10 s), then the run's workers are released."""
    result, seconds, victim = stop_a_worker_once_stepping(
        tmp_path,
        "ray::HFGenerationWorker",
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "deadlines.rollout_wait_s=4",
        "cluster.worker_timeout_s=10",
    )
    line = one_line_error(result)
    assert line.startswith("reinforge: error: rollouts: waited 4 s for the rollout producer"), line
    assert "(deadlines.rollout_wait_s=4); stacks in " in line, line
    assert victim.startswith("generation[")
    assert '"reinforge-rollouts"' in (tmp_path / "run" / "hang_report.txt").read_text()  # blocked in the engine call
    assert seconds < 10 + 40
