"""The supervisor's decisions (reinforge/supervisor.py) and how a run's process ends (exits.py, hang.py): which exit
is restarted, the restart budget renewed by progress, the progress read from the run directory, the one line and
status of each kind of failure, the last line that reaches the supervisor while fd 2 is the run's log, the heartbeat,
and the deadline of a cleanup that never ends. The e2e side, a SIGSTOPped run ended at its heartbeat deadline:
tests/e2e/test_restarts.py."""

import errno
import io
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from reinforge import supervisor
from reinforge.cli import report_failure
from reinforge.errors import ConfigError, InfrastructureError, NumericalError
from reinforge.exits import exit_status
from reinforge.run_dir import announce_run_dir
from reinforge.supervisor import RestartBudget, classify, run_progress


@pytest.mark.parametrize(
    ("code", "stopping", "decision"),
    [
        (0, False, "done"),
        (75, False, "restart"),  # an InfrastructureError or a transient OS/network error
        (-9, False, "restart"),  # SIGKILL: the OOM killer, or ended here for missing its heartbeat
        (-11, False, "restart"),  # a segfault
        (2, False, "stop"),  # the input, non-finite training, or a bug: it would happen again
        (130, False, "stop"),
        (1, False, "stop"),  # Python's own traceback: a crash before the CLI could say anything
        (-15, True, "done"),  # SIGTERM forwarded to the run: the user asked it to stop
        (75, True, "done"),
    ],
)
def test_each_exit_is_restarted_only_when_a_restart_can_fix_it(code, stopping, decision):
    assert classify(code, stopping) == decision


def raised(exc: BaseException, cause: BaseException | None = None, context: BaseException | None = None):
    """`exc` as it arrives at the CLI: raised, with its explicit cause or the exception it was handling."""
    try:
        if context is not None:
            try:
                raise context
            except BaseException:
                raise exc  # noqa: B904  the context, not a cause: a bug while handling another error
        raise exc from cause
    except BaseException as caught:  # noqa: BLE001
        return caught


def http_error(status: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://judge/score", status, "status", {}, None)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (KeyError("prompt_ids"), 2),  # a bug in the driver
        (ConfigError("optimizer.lr=-1 must be > 0"), 2),
        (NumericalError("step 3: the loss is nan"), 2),
        (InfrastructureError("training[1] died"), 75),
        (OSError(errno.ESTALE, "Stale file handle", "/nfs/run/metrics.jsonl"), 75),
        (OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints"), 75),
        (OSError(errno.EIO, "Input/output error"), 75),
        (OSError(errno.ENOENT, "No such file or directory", "data/train.jsonl"), 2),
        (PermissionError(errno.EACCES, "Permission denied", "/run"), 2),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), 75),
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), 75),  # an HTTP write to a peer that went away
        (TimeoutError("timed out"), 75),
        (http_error(429), 75),
        (http_error(503), 75),
        (http_error(404), 2),
        (urllib.error.URLError(ConnectionRefusedError(errno.ECONNREFUSED, "refused")), 75),
        (
            RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/3"),
            75,
        ),
        (raised(RuntimeError("saving the checkpoint failed"), cause=OSError(errno.ENOSPC, "full")), 75),
        # torch.distributed.checkpoint wraps each rank's failure: a full disk under a DCP save is restarted
        (CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)}), 75),
        (CheckpointException("save", {0: (KeyError("model.norm.weight"), None)}), 2),
        (raised(KeyError("step"), context=OSError(errno.ESTALE, "stale")), 2),  # a bug met while handling it
        (raised(ConfigError("bad"), cause=OSError(errno.EIO, "io")), 2),  # a ReinforgeError says for itself
        (KeyboardInterrupt(), 130),
        (None, 0),
    ],
)
def test_the_exit_status_of_each_kind_of_failure(exc, status):
    assert exit_status(exc) == status


def test_requests_transport_errors_and_5xx_are_transient():
    requests = pytest.importorskip("requests")
    assert exit_status(requests.exceptions.ConnectionError("connection aborted")) == 75
    assert exit_status(requests.exceptions.ChunkedEncodingError("incomplete read")) == 75
    answer = requests.Response()
    answer.status_code = 502
    assert exit_status(requests.exceptions.HTTPError("502", response=answer)) == 75
    answer.status_code = 401
    assert exit_status(requests.exceptions.HTTPError("401", response=answer)) == 2


def test_a_bug_in_the_driver_is_one_line_naming_where_with_its_traceback_in_the_run_directory(tmp_path, monkeypatch,
                                                                                              capsys):  # fmt: skip
    monkeypatch.setattr("reinforge.run_dir._announced", [])
    announce_run_dir(tmp_path)
    try:
        {}["prompt_ids"]
    except KeyError as exc:
        status = report_failure(exc)
    line = sys._getframe().f_lineno - 3
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err == (
        f"reinforge: error: a bug, not the input: KeyError: 'prompt_ids' at tests/unit/test_supervisor.py:{line} in "
        f"{sys._getframe().f_code.co_name}; not restarted (it would happen again); the traceback is in "
        f"{tmp_path / 'logs' / 'traceback.txt'}\n"
    )
    assert '{}["prompt_ids"]' in (tmp_path / "logs" / "traceback.txt").read_text()


def test_a_transient_driver_error_is_one_line_and_status_75(capsys):
    status = report_failure(OSError(errno.ESTALE, "Stale file handle", "/nfs/run/metrics.jsonl"))
    assert status == 75
    assert capsys.readouterr().err == (
        "reinforge: error: /nfs/run/metrics.jsonl: Stale file handle (transient: a restart from the last checkpoint "
        "may get past it)\n"
    )


def test_the_budget_renews_once_the_run_gets_renew_steps_past_its_furthest_failure():
    """Hand-computed: limit 3, renewed after 5 steps. Each failure: the step the run had reached."""
    budget = RestartBudget(limit=3, renew_steps=5)
    decisions = [(budget.spend(step), budget.used, budget.renewed) for step in (4, 4, 6, 8)]
    # 4: first (1); 4 again, no progress (2); 6, 2 past 4 (3); 8, 2 past 6: spent, stop
    assert decisions == [(True, 1, False), (True, 2, False), (True, 3, False), (False, 3, False)]
    budget = RestartBudget(limit=3, renew_steps=5)
    decisions = [(budget.spend(step), budget.used, budget.renewed) for step in (30, 25, 36, 36, 36, 36)]
    # 25 (resumed before 30, failed again before it) is no progress; 36 is 6 past 30: renewed; then stuck at 36
    assert decisions == [(True, 1, False), (True, 2, False), (True, 1, True), (True, 2, False), (True, 3, False),
                         (False, 3, False)]  # fmt: skip


def test_four_transient_faults_spread_over_40_steps_are_all_restarted_by_the_default_budget():
    from reinforge.cluster.config import TrainerClusterConfig

    defaults = TrainerClusterConfig()
    for faults in ((10, 20, 30, 40), (8, 16, 24, 32), (5, 12, 21, 39)):
        budget = RestartBudget(defaults.max_restarts, defaults.restart_budget_renew_steps)
        assert all(budget.spend(step) for step in faults), faults
    budget = RestartBudget(defaults.max_restarts, defaults.restart_budget_renew_steps)  # a crash loop at one step
    assert [budget.spend(12) for _ in range(5)] == [True, True, True, False, False]


def test_without_progress_or_renewal_the_budget_is_max_restarts():
    budget = RestartBudget(limit=2, renew_steps=0)
    assert [budget.spend(step) for step in (10, 50, 90)] == [True, True, False]
    budget = RestartBudget(limit=2, renew_steps=5)
    assert [budget.spend(None) for _ in range(3)] == [True, True, False]  # no run directory yet: no progress known


def test_the_progress_is_the_furthest_of_metrics_and_complete_checkpoints(tmp_path):
    assert run_progress(tmp_path) is None and run_progress(None) is None
    rows = [json.dumps({"step": step, "train/reward": 0.5}) for step in range(4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 9, "train/rew\0\0\0')  # torn last line
    assert run_progress(tmp_path) == 3
    for step, complete in ((2, True), (5, True), (7, False)):  # step 7's write never finished
        (tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / f"step_{step:08d}" / "COMPLETE").write_text("{}")
    assert run_progress(tmp_path) == 5


def test_the_settings_come_from_the_file_and_the_overrides_and_a_bad_value_gives_the_default(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("cluster:\n  max_restarts: 5\n  restart_budget_renew_steps: 8\n")
    assert supervisor.settings(str(config), ["cluster.heartbeat_timeout_s=7"]) == supervisor.Settings(5, 8, 7.0)
    assert supervisor.settings(str(config), ["cluster.max_restarts=many"]).max_restarts == 3  # the run refuses it
    assert supervisor.settings(str(tmp_path / "missing.yaml"), []) == supervisor.Settings(3, 5, 120.0)


def test_the_supervisor_keeps_the_runs_last_line_and_last_error_line():
    stream = io.StringIO("loading\nreinforge: error: watchdog: waited 1 s for step 3\nexiting\n\n")
    last, sink = {"error": "", "line": ""}, io.StringIO()
    supervisor._pass_through(stream, sink, last)
    assert last == {"error": "watchdog: waited 1 s for step 3", "line": "exiting"}
    assert sink.getvalue() == stream.getvalue()


def run_script(body: str, directory, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` as a script file of its own (so that its stacks show its lines); (result, seconds it took)."""
    script = directory / "script.py"
    script.write_text(textwrap.dedent(body))
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def test_the_watchdogs_last_line_reaches_the_supervisors_pipe_while_fd_2_is_the_runs_log(tmp_path):
    """The run points fd 2 at RUN_DIR/logs/dependencies.log (logging/capture.py); the watchdog that ends a run that
    does not stop must still be heard by whoever reads the process's stderr: the supervisor."""
    result, _ = run_script(
        f"""
        import time
        from pathlib import Path
        from reinforge import exits, hang
        from reinforge.logging.capture import capture_dependency_logs
        exits.keep_console()
        with capture_dependency_logs(Path({str(tmp_path)!r})):
            with hang.Watchdog(1.0, Path({str(tmp_path / "hang_report.txt")!r}), grace_s=1.0):
                try:
                    time.sleep(30)
                except hang.HangError:
                    time.sleep(30)  # swallowed: the run goes on hanging
    """,
        tmp_path,
    )
    line = (
        "reinforge: error: watchdog: waited 1 s for the first step to make progress (deadlines.step_s=1); stacks in "
        f"{tmp_path / 'hang_report.txt'} (the run did not stop within 1 s: ended)"
    )
    assert result.returncode == 75 and result.stderr.strip().splitlines() == [line], result.stderr
    assert line in (tmp_path / "logs" / "dependencies.log").read_text()  # and the log keeps it


def test_a_cleanup_that_never_ends_is_reported_and_the_process_ends_with_the_runs_status(tmp_path):
    report = tmp_path / "hang_report.txt"
    script = f"""
        import time
        from pathlib import Path
        from reinforge import hang
        from reinforge.errors import InfrastructureError
        hang.enable_exit_deadline()
        hang._ExitDeadline.report = Path({str(report)!r})
        with hang.BoundedExitStack(1.0) as cleanup:
            cleanup.callback(time.sleep, 30)  # a cleanup that never ends: ray.shutdown waiting on a dead node
            cleanup.callback(print, "closing the engines", flush=True)
            raise InfrastructureError("generation[0] died")
    """
    result, took = run_script(script, tmp_path)
    assert result.returncode == 75 and took < 1.0 + 10, (result, took)  # interpreter start-up included
    assert result.stderr.strip().splitlines() == [
        "reinforge: error: generation[0] died; then the run's cleanup did not finish within 1 s "
        f"(deadlines.cleanup_s): ended; stacks in {report}"
    ]
    assert result.stdout == "closing the engines\n"  # the cleanup ran, up to the part that never ended
    assert "with hang.BoundedExitStack(1.0) as cleanup:" in report.read_text()  # where the main thread was


def test_a_thread_that_keeps_the_process_from_exiting_is_bounded_too(tmp_path):
    script = """
        import threading, time
        from reinforge import hang
        hang.enable_exit_deadline()
        threading.Thread(target=time.sleep, args=(30,)).start()  # an executor's worker still in a call
        hang.bound_exit(1.0, 0)  # the CLI, returning 0
    """
    result, took = run_script(script, tmp_path)
    assert result.returncode == 0 and took < 1.0 + 10, (result, took)
    assert result.stderr.strip() == "reinforge: warning: the run's cleanup did not finish within 1 s " \
        "(deadlines.cleanup_s): ended"  # fmt: skip


def test_the_cleanup_deadline_ends_with_the_cleanup_so_a_next_stage_runs_on(tmp_path):
    """A loop's cleanup that ends in time cancels its deadline: a recipe's next stage (a long start-up) runs on."""
    script = """
        import time
        from reinforge import hang
        hang.enable_exit_deadline()
        for stage in range(2):
            with hang.BoundedExitStack(1.0) as cleanup:
                cleanup.callback(time.sleep, 0.2)  # the stage's cleanup, in time
        time.sleep(2.0)  # the next stage's start-up: past the first stage's cleanup deadline
        print("finished", flush=True)
    """
    result, took = run_script(script, tmp_path)
    assert result.returncode == 0 and result.stdout == "finished\n" and not result.stderr, result


HEARTBEAT = """
    import os, re, sys, time
    os.environ["REINFORGE_HEARTBEAT"] = "0.05:" + sys.argv[1]
    from reinforge import exits
    exits.start_heartbeat()
    time.sleep(0.5)
    print("calling", flush=True)
    {call}
    print("returned", flush=True)
"""


def beats_during_the_call(call: str, tmp_path) -> tuple[float, float]:
    """Run a process that beats every 0.05 s and then makes `call` in its main thread; (the longest gap between
    beats seen while the call ran, how long it ran)."""
    script, beat = tmp_path / "beat.py", tmp_path / "heartbeat"
    script.write_text(textwrap.dedent(HEARTBEAT.format(call=call)))
    beat.touch()
    process = subprocess.Popen([sys.executable, str(script), str(beat)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "calling\n"
    started = last_change = time.monotonic()
    seen, gap = beat.stat().st_mtime_ns, 0.0
    while process.poll() is None:
        now = time.monotonic()
        if (mtime := beat.stat().st_mtime_ns) != seen:
            seen, gap, last_change = mtime, max(gap, now - last_change), now
        time.sleep(0.01)
    gap = max(gap, time.monotonic() - last_change)  # a last beat may land after the call, as the process ends
    assert process.stdout.read() == "returned\n"
    return gap, time.monotonic() - started


def test_a_long_call_that_releases_the_gil_keeps_beating_one_that_holds_it_does_not(tmp_path):
    """The supervisor's heartbeat comes from a thread of the run: a long call (a model load, a checkpoint, a sleep)
    keeps it going; C code that holds the GIL (a regular expression backtracking for seconds) stops it, like a
    stopped process."""
    gap, took = beats_during_the_call("time.sleep(1.5)", tmp_path)
    assert took >= 1.5 and gap < 1.0, (gap, took)
    gap, took = beats_during_the_call('re.match(r"(a|aa)*c", "a" * 35)', tmp_path)  # seconds inside the re engine
    assert gap >= 1.0 and gap >= 0.6 * took, (gap, took)


def test_a_restart_waits_for_its_row_to_be_written_when_the_filesystem_failed(tmp_path, monkeypatch, capsys):
    """The run may have failed on a full disk: the supervisor must not die writing restarts.jsonl on it (found by
    bench/faults.py's disk scenario); it waits for the write to succeed (space back), or gives up and says so."""

    path = tmp_path / "not_yet" / "restarts.jsonl"  # the write fails (ENOENT) until the directory appears
    threading.Timer(1.5, path.parent.mkdir).start()
    supervisor.record_restart(path, {"restart": 1})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"restart": 1}]
    monkeypatch.setattr(supervisor, "RECORD_WAIT_S", 1.0)
    supervisor.record_restart(tmp_path / "never" / "restarts.jsonl", {"restart": 2})
    err = capsys.readouterr().err
    assert err.startswith(f"reinforge: cannot write {tmp_path / 'never' / 'restarts.jsonl'} (")
    assert err.rstrip().endswith('its row: {"restart": 2}'), err
