"""Every blocking wait of a run has a deadline (reinforge/hang.py): past it the wait ends with one line that names
the component, what it waited for, for how long and the setting, and the stacks of every thread are kept for
RUN_DIR/hang_report.txt. Each fault is real: a producer thread that never returns, a write into a FIFO nobody reads,
a gloo rank that never joins the collective, a TCP server that accepts and never answers, an engine call that never
returns; the watchdog is tested on a loop that stops beating. Deadlines of a second or two."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from reinforge.data.prompts import Prompt, PromptSampler
from reinforge.envs.base import EnvRequest
from reinforge.envs.http_client import RemoteEnvironment
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.hang import REPORT_NAME, HangError, Watchdog, hang_reports
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.network import free_port
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.source import AsyncRollouts
from reinforge.serving.app import build_app
from reinforge.serving.config import ServingConfig
from reinforge.serving.server import PolicyServer
from reinforge.training.checkpoint import latest_checkpoint, save_checkpoint

SLACK_S = 3.0  # what a deadline may be overrun by on a busy 2-core machine (thread start-up, the stack dump)


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_a_stuck_rollout_producer_stops_the_trainer_at_the_rollout_deadline(tmp_path):
    release = threading.Event()

    def stuck_produce(step):
        release.wait()  # a generation call that never returns
        return [], {}

    sampler = PromptSampler([Prompt({"index": 0}, [], [100])], batch_size=1, seed=0, shuffle=False)
    rollouts = AsyncRollouts(stuck_produce, sampler, 0, 3, 0, wait_timeout_s=1.5)
    started = time.monotonic()
    try:
        with pytest.raises(HangError) as raised, hang_reports(tmp_path):
            rollouts.get(1)
        waited = time.monotonic() - started
    finally:
        release.set()
        rollouts.close()
    assert 1.5 <= waited < 1.5 + SLACK_S
    report = tmp_path / REPORT_NAME
    assert one_line(raised.value) == (
        "rollouts: waited 1.5 s for the rollout producer's batch of step 1 (deadlines.rollout_wait_s=1.5); "
        f"stacks in {report}"
    )
    text = report.read_text()
    first_line = text.splitlines()[0]
    assert first_line.startswith(time.strftime("%Y-%m-%d")) and first_line.endswith("(deadlines.rollout_wait_s=1.5)")
    assert '"reinforge-rollouts"' in text and "in stuck_produce" in text  # the producer's thread, where it is stuck
    assert '"MainThread"' in text


def test_a_checkpoint_write_that_blocks_ends_at_the_checkpoint_deadline(tmp_path):
    class StuckDisk:
        """Writes its state into a FIFO that nobody reads: the open blocks, as a write to a hung mount does."""

        def save_state(self, path):
            path.mkdir()
            os.mkfifo(path / "state.pt")
            (path / "state.pt").write_bytes(b"weights")

    started = time.monotonic()
    with pytest.raises(HangError, match=r"^checkpoint: waited 1 s for checkpoint 3 to be written "):
        save_checkpoint(tmp_path, 3, StuckDisk(), {"step": 3}, "", timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert latest_checkpoint(tmp_path) is None  # nothing half-written is taken for a checkpoint


def test_the_watchdog_stops_a_loop_that_stops_beating_and_writes_the_report(tmp_path):
    report = tmp_path / REPORT_NAME
    started = time.monotonic()
    with pytest.raises(HangError) as raised, Watchdog(1.0, report) as watchdog:
        for step in range(1, 6):  # 5 steps of 0.3 s: each beats in time
            watchdog.beat(f"step {step}")
            time.sleep(0.3)
        watchdog.beat("step 6")
        time.sleep(30)  # a step that makes no progress at all
    stopped = time.monotonic() - started
    assert 1.5 + 1.0 <= stopped < 1.5 + 1.0 + SLACK_S
    assert one_line(raised.value) == (
        f"watchdog: waited 1 s for step 6 to make progress (deadlines.step_s=1); stacks in {report}"
    )
    assert "in test_the_watchdog_stops_a_loop_that_stops_beating" in report.read_text()  # where the main thread was


def test_the_watchdog_ends_a_process_that_does_not_stop_on_its_own(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from reinforge.hang import HangError, Watchdog
        with Watchdog(1.0, Path({str(tmp_path / REPORT_NAME)!r}), grace_s=1.0):
            try:
                time.sleep(30)
            except HangError:
                time.sleep(30)  # swallowed: the run goes on hanging
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 2.0 + 10  # interpreter start-up and imports included
    assert result.returncode == 75  # an infrastructure failure's status: a supervised run restarts
    assert result.stderr.strip().splitlines() == [
        "reinforge: error: watchdog: waited 1 s for the first step to make progress (deadlines.step_s=1); stacks in "
        f"{tmp_path / REPORT_NAME} (the run did not stop within 1 s: ended)"
    ]


RANK = """
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
rank, port, ready = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
(ready / str(rank)).touch()
while len(list(ready.iterdir())) < 2:  # both imported: the 2 s also bound the rendezvous
    time.sleep(0.01)
FSDP2Strategy(rank, 2, "127.0.0.1", port).setup(TrainingConfig(collective_timeout_s=2.0))
if rank == 1:
    time.sleep(60)  # never joins the collective
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except Exception as exc:
    print(f"raised after {time.monotonic() - started:.1f} s: {type(exc).__name__}", flush=True)
"""


def test_a_rank_that_never_joins_a_collective_makes_it_raise_at_the_collective_timeout(tmp_path):
    port = free_port("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for rank in (0, 1)]  # fmt: skip
    try:
        output, _ = ranks[0].communicate(timeout=50)
    finally:
        for rank in ranks:
            rank.kill()
    assert "raised after " in output, output[-3000:]
    seconds = float(output.split("raised after ")[1].split(" s")[0])
    assert 2.0 <= seconds < 2.0 + SLACK_S, output


@pytest.fixture
def silent_server():
    """A real TCP server on 127.0.0.1 that accepts every connection and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted, stop = [], threading.Event()

    def serve():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(sock.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", accepted
    stop.set()
    thread.join()
    for connection in accepted:
        connection.close()
    sock.close()


def test_an_env_server_that_never_answers_ends_the_call_within_its_timeout_and_retries(silent_server):
    """timeout 1 s, 1 retry after 0.2 s: (1 + 1) x 1 + 0.2 = 2.2 s at most, then the batch is an infra failure."""
    url, accepted = silent_server
    env = RemoteEnvironment(url, token=None, timeout_s=1.0, max_retries=1, backoff_s=0.2, batch_size=8)
    started = time.monotonic()
    responses = env.step([EnvRequest([{"role": "assistant", "content": "7"}], {"answer": "7"})])
    assert 2.2 <= time.monotonic() - started < 2.2 + SLACK_S
    assert len(accepted) == 2  # the first try and the retry, each accepted and left unanswered
    assert [response.infra_failure for response in responses] == ["timeout"]
    assert "\n" not in responses[0].info["infra_error"]


DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))


@pytest.fixture(scope="module")
def stuck_engine():
    """The demo model's engine, whose generate call blocks until `release` is set: an engine that never answers."""
    tokenizer = load_tokenizer(DEMO)
    engine = HFGenerationBackend(load_model(DEMO), tokenizer, max_batch_size=8)
    release, generate = threading.Event(), engine.generate
    engine.generate = lambda *args, **kwargs: (release.wait(), generate(*args, **kwargs))[1]
    yield engine, tokenizer, release
    release.set()


def endpoint(stuck_engine, managed: bool) -> PolicyServer:
    engine, tokenizer, _ = stuck_engine
    config = ServingConfig(batch_wait_s=0, request_timeout_s=1.0)
    server = PolicyServer(engine, tokenizer, config, max_model_len=160, default_max_tokens=4, managed=managed)
    return server.start(build_app(server))


def test_a_request_the_engine_never_answers_gets_a_504_at_the_request_timeout(stuck_engine):
    server = endpoint(stuck_engine, managed=False)
    try:
        started = time.monotonic()
        messages = [{"role": "user", "content": "2 + 2?"}]
        answer = httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages}, timeout=30)
        assert 1.0 <= time.monotonic() - started < 1.0 + SLACK_S
        assert answer.status_code == 504
        assert answer.json()["error"]["message"] == (
            "no completion within 1 s (request_timeout_s): the engine is overloaded or stuck"
        )
    finally:
        stuck_engine[2].set()
        server.stop()
        stuck_engine[2].clear()


def test_a_rollout_whose_requests_the_engine_never_answers_ends_at_the_request_timeout(stuck_engine):
    server = endpoint(stuck_engine, managed=True)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1)
    try:
        with pytest.raises(HangError) as raised:
            with server.rollout_session(params):
                messages = [{"role": "user", "content": "2 + 2?"}]
                httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages}, timeout=30)
                started = time.monotonic()  # the 504 came; the close now waits for the engine's call in flight
        assert 1.0 <= time.monotonic() - started < 1.0 + SLACK_S
        assert one_line(raised.value) == (
            "policy endpoint: waited 1 s for the engine to answer the requests in flight "
            "(agent.endpoint.request_timeout_s=1)"
        )
        assert "reinforge-endpoint-batcher" in raised.value.stacks  # the thread stuck in the engine
    finally:
        stuck_engine[2].set()
        server.stop()
        stuck_engine[2].clear()
