"""Infrastructure failures are not the policy's (rollout/infra.py, docs/environments.md), on real components:
the demo model generating with the HF engine, a real reinforge env server (uvicorn, on 127.0.0.1) that fails
half of its requests at random, and the real sandbox.

- No failed request becomes a reward: every trajectory kept scores exactly what the environment gives its
  answer, the failures are retried, and rollout/infra_env_server counts every one of them.
- A short GRPO run through that server finishes.
- A program that crashes by itself still scores 0 and is no infra failure; a sandbox killed from outside is
  one, and its episode is run again.
"""

import contextlib
import json
import os
import random
import signal
import socket
import threading
import time

import pytest
import uvicorn

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.envs.code_env import CodeEnv, CodeEnvConfig
from reinforge.envs.http_client import EnvServerError, RemoteEnvironment
from reinforge.envs.http_server import build_app
from reinforge.envs.math_env import MathEnv
from reinforge.envs.sandbox import SandboxLimits
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.infra import InfraLimits
from reinforge.rollout.rollout import ReinforgeRollout, RolloutOptions

DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
RECORDS = read_jsonl(PROJECT_ROOT / "data" / "demo" / "train.jsonl")[:4]


class Flaky:
    """A real environment that fails half of its calls at random: the server answers those with HTTP 500."""

    def __init__(self, inner, seed: int = 0):
        self.inner, self.random, self.lock, self.num_failed = inner, random.Random(seed), threading.Lock(), 0

    def _maybe_fail(self) -> None:
        with self.lock:
            if self.random.random() < 0.5:
                self.num_failed += 1
                raise RuntimeError("injected infrastructure failure")

    def step(self, requests):
        self._maybe_fail()
        return self.inner.step(requests)

    def metrics(self):
        self._maybe_fail()
        return self.inner.metrics()

    def close(self):
        self.inner.close()


class LengthScore:
    """reward = 1 + (characters of the answer mod 4) / 4: known for every answer, and never 0."""

    def step(self, requests):
        return [EnvResponse(reward=score(r.messages[-1]["content"])) for r in requests]

    def metrics(self):
        return {}

    def close(self):
        pass


def score(text: str) -> float:
    return 1.0 + (len(text) % 4) / 4


@contextlib.contextmanager
def served(env):
    """`build_app(env)` under uvicorn in a thread, on a socket bound here; yields its URL."""
    with served_app(build_app(env, token=None, max_request_bytes=1 << 20)) as url:
        yield url


@pytest.fixture(scope="module")
def demo():
    tokenizer = load_tokenizer(DEMO)
    return tokenizer, HFGenerationBackend(load_model(DEMO), tokenizer, max_batch_size=64)


def prompts_for(tokenizer, records):
    return [render_prompt(r, tokenizer, "prompt", None, use_chat_template=True) for r in records]


def test_no_failed_request_becomes_a_reward_and_every_failure_is_retried_and_counted(demo):
    tokenizer, engine = demo
    flaky = Flaky(LengthScore())
    with served(flaky) as url:
        env = RemoteEnvironment(url, token=None, timeout_s=30.0, max_retries=0, backoff_s=0.0, batch_size=1)
        limits = InfraLimits(max_retries=4, min_valid_per_group=2, max_failure_fraction=0.5)
        episodes = ReinforgeRollout(engine, tokenizer, {"math": env}, RolloutOptions(default_task="math"), limits)
        params = SamplingParams(max_new_tokens=16, temperature=1.0, num_samples=4, seed=1)
        trajectories = episodes(prompts_for(tokenizer, RECORDS), params)
        metrics = episodes.metrics()
        env.close()
    print(f"\n{flaky.num_failed} requests failed; {metrics}")
    assert len(trajectories) == 16 and [t.group for t in trajectories] == [i // 4 for i in range(16)]
    assert flaky.num_failed >= 4  # one request per trajectory: about half of the first 16 failed
    assert metrics["rollout/infra_env_server"] == flaky.num_failed  # every failure counted, as what it was
    assert metrics["rollout/infra_retried"] == flaky.num_failed - metrics["rollout/infra_masked"]
    for trajectory in trajectories:
        if trajectory.excluded:  # failed 5 times: masked, and no reward was made up for it
            assert trajectory.masked and trajectory.infra_failure == "env_server"
            assert f"environment server {url} failed POST /verify after 1 attempt: HTTP 500" in trajectory.infra_error
        else:
            assert trajectory.reward == score(trajectory.response_text) >= 1.0 and trajectory.infra_failure is None


class Slow(LengthScore):
    def step(self, requests):
        time.sleep(1.0)
        return super().step(requests)


def test_a_server_that_does_not_answer_in_time_is_a_timeout_and_a_4xx_still_stops_the_run():
    request = EnvRequest(messages=[{"role": "assistant", "content": "42"}], record={})
    with served(Slow()) as url:
        env = RemoteEnvironment(url, token=None, timeout_s=0.3, max_retries=1, backoff_s=0.0, batch_size=1)
        (response,) = env.step([request])
        env.close()
    assert response.infra_failure == "timeout" and "after 2 attempts: ReadTimeout" in response.info["infra_error"]
    with served(MathEnv()) as url:  # a record the environment cannot score is the run's error, not infrastructure
        env = RemoteEnvironment(url, token=None, timeout_s=5.0, max_retries=1, backoff_s=0.0, batch_size=1)
        with pytest.raises(EnvServerError, match="HTTP 422: MathEnv needs an 'answer'"):
            env.step([request])
        env.close()


def test_a_short_grpo_run_through_a_server_failing_half_its_requests_finishes(tmp_path):
    flaky = Flaky(MathEnv(), seed=3)
    with served(flaky) as url:
        overrides = [
            "loop.max_steps=2",
            "loop.val_every=0",
            "rollout.num_prompts_per_step=4",
            "rollout.num_generations_per_prompt=4",
            "rollout.max_infra_retries=4",
            "training.global_batch_size=16",
            "training.micro_batch_size=16",
            "generation.max_new_tokens=16",
            "data.max_val_prompts=4",
            "checkpoint.save_final=false",
            "cluster.num_threads=1",
            f"env.remote.math.url={url}",
            "env.remote.math.max_retries=0",
            "env.remote.math.backoff_s=0",
            "env.remote.math.batch_size=2",
            f"logging.run_dir={tmp_path / 'run'}",
        ]
        loops.train(load_config(PROJECT_ROOT / "configs" / "grpo_demo.yaml", overrides))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/reward_mean" in row]
    assert len(steps) == 2 and flaky.num_failed > 0
    assert sum(row["rollout/infra_env_server"] for row in steps) > 0
    assert all(row["train/num_optimizer_steps"] >= 1 for row in steps)
    assert "val/accuracy" in rows[-1] and "val/infra_retried" in rows[-1]


# The sandbox: the program's own crash against a sandbox killed from outside.

CODE_RECORD = {"tests": ["assert True"]}


def code_request(program: str) -> EnvRequest:
    return EnvRequest(messages=[{"role": "assistant", "content": f"```python\n{program}\n```"}], record=CODE_RECORD)


def supervisors() -> list[int]:
    """This process's sandbox supervisors (`python -I -S -c <bootstrap>`), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                parent = int(file.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"supervise(job)" in command:
            found.append(int(entry))
    return found


class SupervisorKiller:
    """Kills (SIGKILL) the first `count` sandbox supervisors this process starts, from outside the sandbox."""

    def __init__(self, count: int):
        self.count, self.killed, self.stop = count, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while len(self.killed) < self.count and not self.stop.is_set():
            for pid in supervisors():
                if pid not in self.killed and len(self.killed) < self.count:
                    time.sleep(0.05)  # let it start the program
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)
            time.sleep(0.005)

    def __enter__(self) -> "SupervisorKiller":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def code_env():
    with CodeEnv(CodeEnvConfig(sandbox=SandboxLimits(wall_time_s=5.0), num_parallel=2)) as env:
        env.step([code_request("pass")])  # the sandbox's one-time probe runs before any killer starts
        env.metrics()
        yield env


@pytest.mark.xdist_group("sandbox")
@pytest.mark.parametrize(
    "program, status",
    [
        ("raise SystemExit(1)", "ok"),  # the harness catches it: the program fails to load, every test fails
        ("import sys\nsys.stdout.flush()\nimport os\nos._exit(1)", "failed"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed"),
        ("while True:\n    pass", "timeout"),
    ],
)
def test_a_program_that_crashes_by_itself_scores_0_and_is_not_an_infra_failure(code_env, program, status):
    if status == "timeout":  # within the program's own limits: the policy's failure
        with CodeEnv(CodeEnvConfig(sandbox=SandboxLimits(wall_time_s=1.0, cpu_time_s=1.0))) as env:
            (response,) = env.step([code_request(program)])
    else:
        (response,) = code_env.step([code_request(program)])
    assert response.reward == 0.0 and response.infra_failure is None, response
    assert response.info["status"] == status


@pytest.mark.xdist_group("sandbox")
def test_a_sandbox_killed_from_outside_is_an_infra_failure(code_env):
    slow = "import time\ntime.sleep(1.0)"
    with SupervisorKiller(count=1) as killer:
        (response,) = code_env.step([code_request(slow)])
    assert len(killer.killed) == 1
    assert response.infra_failure == "sandbox" and response.info["status"] == "error"
    assert "supervisor exited with -9" in response.info["infra_error"]
    assert code_env.metrics()["sandbox_errors"] == 1.0
    (again,) = code_env.step([code_request(slow)])  # nothing kills it this time: the program's real verdict
    assert again.reward == 1.0 and again.infra_failure is None


@pytest.mark.xdist_group("sandbox")
def test_a_python_tool_whose_sandbox_is_killed_from_outside_is_an_infra_failure_not_an_observation():
    from reinforge.envs.tool_use import ToolUseEnv, ToolUseEnvConfig

    env = ToolUseEnv(ToolUseEnvConfig(sandbox=SandboxLimits(wall_time_s=5.0)), answer_env=MathEnv())
    slow = '<tool_call>{"name": "python", "arguments": {"code": "import time; time.sleep(1.0); print(7)"}}</tool_call>'
    request = EnvRequest(messages=[{"role": "assistant", "content": slow}], record={"answer": "7"})
    env.step([EnvRequest(messages=[{"role": "assistant", "content": slow.replace("1.0", "0")}], record={})])  # probe
    with SupervisorKiller(count=1) as killer:
        (response,) = env.step([request])
    assert len(killer.killed) == 1
    assert response.infra_failure == "sandbox" and response.observation is None
    assert "python tool's sandbox failed" in response.info["infra_error"]
    (again,) = env.step([request])  # nothing kills it this time: the program's real output
    assert again.observation == [{"role": "tool", "content": "7\n"}] and again.infra_failure is None
    assert env.metrics()["tool_failures"] == 1.0
    env.close()


@pytest.mark.xdist_group("sandbox")
def test_an_episode_whose_sandbox_was_killed_is_run_again_and_scored_for_real(demo, code_env):
    """Each run sleeps 0.5 s first (the record's test_imports), so the killer catches both first runs."""
    tokenizer, engine = demo
    record = {"prompt": "Write a program.", "task": "code", "tests": ["assert True"]}
    record["test_imports"] = ["import time; time.sleep(0.5)"]
    limits = InfraLimits(max_retries=2, min_valid_per_group=2, max_failure_fraction=0.5)
    episodes = ReinforgeRollout(engine, tokenizer, {"code": code_env}, RolloutOptions(default_task="code"), limits)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, num_samples=2, seed=5)
    with SupervisorKiller(count=2) as killer:
        trajectories = episodes(prompts_for(tokenizer, [record]), params)
    metrics = episodes.metrics()
    assert len(killer.killed) == 2
    assert metrics["rollout/infra_sandbox"] == 2 and metrics["rollout/infra_retried"] == 2
    assert metrics["rollout/infra_masked"] == 0 and not any(t.excluded for t in trajectories)
    answers = [
        EnvRequest(messages=[{"role": "assistant", "content": t.response_text}], record=record) for t in trajectories
    ]
    truth = code_env.step(answers)
    assert [t.reward for t in trajectories] == [r.reward for r in truth]


# Agents: an HTTP failure is infrastructure, the agent's own exception is not.


def status_app():
    """Answers POST /run (a Gym agent's route) and POST /status/{code}/v1/chat/completions with the status asked."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/run")
    async def run(request: Request):
        return JSONResponse({"detail": "as asked"}, status_code=(await request.json())["status"])

    @app.post("/status/{code}/v1/chat/completions")
    async def chat(code: int):
        return JSONResponse({"error": {"message": "as asked"}}, status_code=code)

    return app


@contextlib.contextmanager
def served_app(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def raised_by(call):
    try:
        call()
    except Exception as exc:
        return exc
    pytest.fail("expected an exception")


def test_an_http_failure_in_an_agents_exception_chain_is_infrastructure_and_its_own_error_is_not():
    from openai import OpenAI

    from reinforge.network import free_port
    from reinforge.rollout.agent_runners import http_failure

    def ask(base_url):
        client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=5.0)
        return lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    with served_app(status_app()) as url:
        assert http_failure(raised_by(ask(f"{url}/status/500/v1")))  # openai.InternalServerError
        assert http_failure(raised_by(ask(f"{url}/status/503/v1")))
        assert http_failure(raised_by(ask(f"{url}/status/429/v1")))  # openai.RateLimitError: the endpoint's full queue
        assert not http_failure(raised_by(ask(f"{url}/status/400/v1")))  # the agent's bad request: its own
    assert http_failure(raised_by(ask(f"http://127.0.0.1:{free_port('127.0.0.1')}/v1")))  # APIConnectionError
    assert not http_failure(ValueError("the agent's own bug"))

    def wrapped():
        try:
            ask(f"http://127.0.0.1:{free_port('127.0.0.1')}/v1")()
        except Exception as exc:
            raise RuntimeError("my tool failed") from exc

    assert http_failure(raised_by(wrapped))  # anywhere in the chain of causes


def test_a_gym_agent_server_5xx_or_unreachable_is_infrastructure_and_a_4xx_is_the_agents():
    import asyncio

    import httpx

    from reinforge.network import free_port
    from reinforge.rollout.agent_runners import GymAgentRunner

    async def run(url, status):
        async with httpx.AsyncClient() as client:
            return await GymAgentRunner("weather", url, 5.0, max_retries=1, backoff_s=0.0).run(
                client, {"status": status}
            )

    with served_app(status_app()) as url:
        server_error, bad_row = asyncio.run(run(url, 502)), asyncio.run(run(url, 422))
    down = asyncio.run(run(f"http://127.0.0.1:{free_port('127.0.0.1')}", 200))
    assert server_error.status == "failed" and server_error.infra_failure == "gym_server"
    assert bad_row.status == "failed" and bad_row.infra_failure is None
    assert down.infra_failure == "gym_server" and "cannot be reached after 2 attempts: ConnectError" in down.error
