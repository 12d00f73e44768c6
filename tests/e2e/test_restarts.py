"""Automatic recovery (cluster.max_restarts, reinforge/supervisor.py): a run whose process or training rank is killed
with SIGKILL mid-step, or whose rank is stopped (SIGSTOP, noticed by its heartbeat), restarts itself from its last
checkpoint and ends with the metrics of a run never killed; past the bound the command stops with one line."""

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from _kill import cli_command, cmdline, descendants, json_rows
from test_hangs import read_hang_report

from reinforge.paths import PROJECT_ROOT

ARGS = [
    "loop.max_steps=4",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=24",
    "data.max_val_prompts=4",
    "loop.val_every=2",
    "checkpoint.save_every=1",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
]
FSDP2 = ["training.backend=fsdp2", "training.num_workers=2"]


def command(run_dir, *extra):
    return cli_command("grpo", PROJECT_ROOT / "configs" / "grpo_demo.yaml", *ARGS, *extra, f"logging.run_dir={run_dir}")


def comparable(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def run_and_kill(command_line, run_dir, victim_pattern: str) -> subprocess.CompletedProcess:
    """Start the command; once step 2 is checkpointed and step 3 has begun, SIGKILL the newest process of its tree
    whose command line contains `victim_pattern`; return the command's result."""
    process = subprocess.Popen(command_line, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = run_dir / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 300
    while process.poll() is None and not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # into step 3: generation or training
    victims = [pid for pid in descendants(process.pid) if victim_pattern in cmdline(pid)]
    assert victims, f"no process matching {victim_pattern!r} under the run"
    os.kill(victims[-1], signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(command_line, process.returncode, stdout, stderr)


def test_a_killed_run_process_restarts_from_its_checkpoint_and_ends_like_a_run_never_killed(tmp_path):
    reference = subprocess.run(command(tmp_path / "reference"), capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "killed"
    result = run_and_kill(command(run), run, "reinforge.cli grpo")  # the run's own process: the torch backend's rank
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["cause"] == "the run's process was killed by SIGKILL", restarts
    assert "reinforge: restart 1 of 3" in result.stderr and "(resumed from step_0000000" in result.stdout
    assert comparable(run) == comparable(tmp_path / "reference")


def wait_for(process: subprocess.Popen, path, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while process.poll() is None and not path.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"{path} never came: {process.poll()}"


def ranks_of(process: subprocess.Popen) -> list[int]:
    return [pid for pid in descendants(process.pid) if "ray::Backend" in cmdline(pid)]


@pytest.mark.xdist_group("ray")
def test_a_stopped_and_then_a_killed_fsdp2_rank_each_restart_the_run_and_it_ends_like_a_run_never_killed(tmp_path):
    """One supervised run on two FSDP2 ranks, cluster.max_restarts at its default: a rank SIGSTOPped once step 1 is
    checkpointed (the calls may take 600 s, cluster.worker_timeout_s's default) is noticed by its heartbeat in seconds,
    named as stopped, its own stack in the hang report; a rank of the restarted run SIGKILLed mid-step 3 ends that
    attempt within seconds with one line naming it as died (exit 75: restartable), and every Ray process of that
    attempt exits on its own; each restart resumes from the newest checkpoint, and the run ends with the metrics of a
    run never killed."""
    reference = subprocess.run(command(tmp_path / "reference", *FSDP2), capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "run"
    line = command(run, *FSDP2, "cluster.heartbeat_timeout_s=5")
    process = subprocess.Popen(line, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        wait_for(process, run / "checkpoints" / "step_00000001" / "COMPLETE")
        stopped = ranks_of(process)[-1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        wait_for(process, run / "restarts.jsonl")  # the heartbeat's restart, from step 1
        wait_for(process, run / "checkpoints" / "step_00000002" / "COMPLETE")
        time.sleep(0.2)  # into step 3: generation or training
        attempt = [pid for pid in descendants(process.pid) if "reinforge.cli grpo" in cmdline(pid)][-1]
        ours = [
            pid for pid in descendants(attempt) if any(n in cmdline(pid) for n in ("ray::", "raylet", "gcs_server"))
        ]
        assert len(ours) >= 4, ours  # the ranks, the engine's actor, raylet, GCS
        os.kill([pid for pid in ranks_of(process) if pid != stopped][-1], signal.SIGKILL)
        killed_at = time.time()
        while process.poll() is None and len(json_rows(run / "restarts.jsonl")) < 2 and time.time() < killed_at + 60:
            time.sleep(0.1)
        ended_after = time.time() - killed_at
        while [pid for pid in ours if cmdline(pid)] and time.time() < killed_at + ended_after + 30:
            time.sleep(0.5)  # every Ray process of the killed attempt exits on its own
        left = [cmdline(pid) for pid in ours if cmdline(pid)]
        stdout, stderr = process.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):  # gone once restarted; if not, so it can be killed
            os.kill(stopped, signal.SIGCONT)
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    seconds, victim = read_hang_report(run, stopped, stopped_at)
    assert seconds < 5 + 40  # the heartbeat timeout, a look, the stack dumps
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 2, restarts
    hang, died = restarts[0]["cause"], restarts[1]["cause"]
    assert hang.startswith(f"training: waited 5 s for a heartbeat from {victim} (pid {stopped}"), hang
    assert ": stopped (T)) in " in hang and hang.endswith(f"(cluster.heartbeat_timeout_s=5); stacks in {run}/"
                                                            "hang_report.txt"), hang  # fmt: skip
    assert died.startswith("training[") and "died" in died, died
    assert restarts[1]["exit"] == 75 and restarts[1]["last_line"] == f"reinforge: error: {died}", restarts[1]
    assert ended_after < 30 and left == [], (ended_after, left)
    assert "reinforge: restart 2 of 3" in stderr and "(resumed from step_00000002)" in stdout
    assert comparable(run) == comparable(tmp_path / "reference")


def test_past_cluster_max_restarts_the_command_stops_with_one_line(tmp_path):
    """Every attempt is killed as soon as its run directory exists: one restart, then the end."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        command(run, "cluster.max_restarts=1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    killed, deadline = set(), time.time() + 120
    while process.poll() is None and time.time() < deadline:
        if (run / "config.yaml").exists():
            for pid in descendants(process.pid):
                if "reinforge.cli grpo" in cmdline(pid) and pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        time.sleep(0.05)
    stderr = process.stderr.read()
    assert process.wait(timeout=30) == 128 + signal.SIGKILL and len(killed) == 2, (killed, stderr)
    lines = stderr.strip().splitlines()
    assert lines[-1] == (
        "reinforge: error: the run failed 2 times, the last time with: the run's process was killed by SIGKILL; "
        "gave up after cluster.max_restarts=1 restarts"
    ), stderr
    assert sum(line.startswith("reinforge: restart 1 of 1") for line in lines) == 1
    assert len((run / "restarts.jsonl").read_text().splitlines()) == 1


def test_a_stopped_run_process_ends_at_its_heartbeat_deadline_with_a_hang_report_and_is_restarted(tmp_path):
    """SIGSTOP, as a wedged process that holds the GIL: its own watchdog thread cannot run, its heartbeat stops. The
    supervisor writes the hang report (state, stacks), kills it, and the restart finishes the run from its
    checkpoint."""
    run = tmp_path / "run"
    timeout_s = 5.0  # a few seconds: a loaded machine may delay a beat by one or two
    line = command(run, "loop.max_steps=2", "loop.val_every=0", f"cluster.heartbeat_timeout_s={timeout_s:g}")
    process = subprocess.Popen(line, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker, deadline = run / "checkpoints" / "step_00000001" / "COMPLETE", time.time() + 300
    while process.poll() is None and not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    victims = [pid for pid in descendants(process.pid) if "reinforge.cli grpo" in cmdline(pid)]
    assert victims, f"no run process under the command: {process.poll()}"
    os.kill(victims[0], signal.SIGSTOP)
    stopped_at = time.time()
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["exit"] == -signal.SIGKILL, restarts
    cause = restarts[0]["cause"]
    assert cause.startswith(f"the run's process sent no heartbeat for {timeout_s:.0f} s"), cause
    assert "its state: stopped (T)" in cause and cause.endswith(f"stacks in {run / 'hang_report.txt'}"), cause
    assert restarts[0]["time"] - stopped_at < timeout_s + 20  # the deadline, a poll, py-spy's dump
    report = (run / "hang_report.txt").read_text()
    assert f"(pid {victims[0]}): no heartbeat for" in report and "state stopped (T)" in report, report[:3000]
    assert "Thread" in report or "no stacks" in report, report  # py-spy's dump of the stopped process, where present
    assert "reinforge: restart 1 of 3" in stderr and "(resumed from step_00000001)" in stdout
    assert [row["step"] for row in json_rows(run / "metrics.jsonl")][-1] == 2
