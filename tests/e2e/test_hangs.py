"""A run whose Ray worker stops answering (SIGSTOP: alive, but never running again) ends within its deadline with
one line naming the component, what it waited for and the setting, after writing RUN_DIR/hang_report.txt with the
driver's threads and, by py-spy, the stopped worker's own stack. Real GRPO runs on the demo model."""

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


def stop_a_worker_once_stepping(tmp_path, pattern: str, *overrides) -> tuple[subprocess.CompletedProcess, float, str]:
    """Start the run; once it logged a step, SIGSTOP one of its Ray workers named `pattern`; return how the run
    ended, how long after the stop, and the stopped worker's name."""
    run_dir = tmp_path / "run"
    config = str(PROJECT_ROOT / "configs" / "grpo_demo.yaml")
    command = [sys.executable, "-m", "reinforge.cli", "grpo", "--config", config, *ARGS, *overrides,
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
        stdout, stderr = run.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone once the run ended; if not, so that it can be killed
            os.kill(victims[-1], signal.SIGCONT)
        run.kill()
    report = run_dir / "hang_report.txt"
    assert report.is_file(), stderr[-3000:]
    text = report.read_text()
    assert f"(pid {victims[-1]}) ==" in text, text[-3000:]
    before, after = text.split(f" (pid {victims[-1]}) ==", 1)
    victim, victim_stack = before.rsplit("== Ray worker ", 1)[1], after.split("\n== ", 1)[0]
    assert "Thread" in victim_stack and "(no stacks" not in victim_stack, victim_stack  # py-spy read the stopped one
    assert '"MainThread"' in text and '"reinforge-watchdog"' in text
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr), time.time() - stopped_at, victim


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 75, result.stderr[-3000:]  # an infrastructure failure: restartable
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_a_stopped_training_rank_ends_the_run_at_the_worker_timeout_with_its_stack(tmp_path):
    result, seconds, victim = stop_a_worker_once_stepping(
        tmp_path, "ray::Backend", "training.backend=fsdp2", "training.num_workers=2", "cluster.worker_timeout_s=10"
    )
    line = one_line_error(result)
    assert line.startswith("reinforge: error: training: waited 10 s for ") and victim in line, line
    assert line.endswith(f"(cluster.worker_timeout_s=10); stacks in {tmp_path / 'run' / 'hang_report.txt'}"), line
    assert seconds < 10 + 40  # the wait, the stack dumps, the workers' release


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
