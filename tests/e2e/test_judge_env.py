"""The judge environment against real servers on 127.0.0.1, each in its own process.

- the reward-model server (`reinforge serve-rm`) with a tiny random Qwen2ForSequenceClassification:
  the same scores over HTTP as in-process;
- vLLM's OpenAI-compatible server with the demo model: the chat request and the parse path round-trip
  (the demo model cannot judge, so only the plumbing is checked);
- a deterministic chat-completions judge defined below (run as `python test_judge_env.py PORT`):
  exact rubric formatting and parsing, retries, timeouts, and a judge killed mid-step.
"""

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from _servers import server_process
from pydantic import ValidationError

from reinforge.envs.base import EnvRequest
from reinforge.envs.judge import JudgeEnv, JudgeEnvConfig, JudgeError
from reinforge.errors import ConfigError
from reinforge.network import free_port

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
RUBRIC = "Question: {question}\nReference: {reference}\nResponse: {response}"


def fake_judge_app():
    """A chat-completions judge with a fixed rule: "Draft [[5]]. Final: [[10]]" when the reference
    appears in the response, "... [[0]]" otherwise. Words in the response change its behaviour:
    GARBLE (no score), OUTOFRANGE ([[11]]), SLEEP (answers after 60 s), FLAKY-N (HTTP 503 for
    the first N calls with that response). A model other than "judge" gets 404."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    received = []
    calls = collections.Counter()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/received")
    def get_received():
        return received

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        received.append(body)
        if body["model"] != "judge":
            return JSONResponse({"error": {"message": f"the model {body['model']} does not exist"}}, status_code=404)
        prompt = body["messages"][-1]["content"]
        reference = re.search(r"^Reference: (.*)$", prompt, re.M).group(1)
        response = prompt.split("\nResponse: ", 1)[1]
        calls[response] += 1
        flaky = re.search(r"FLAKY-(\d+)", response)
        if flaky and calls[response] <= int(flaky.group(1)):
            return JSONResponse({"error": "overloaded"}, status_code=503)
        if "SLEEP" in response:
            await asyncio.sleep(60)
        if "GARBLE" in response:
            verdict = "I cannot decide."
        elif "OUTOFRANGE" in response:
            verdict = "Final: [[11]]"
        else:
            verdict = "Draft [[5]]. Final: " + ("[[10]]" if reference in response else "[[0]]")
        return {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": verdict}, "finish_reason": "stop"}]
        }

    return app


@contextlib.contextmanager
def fake_judge():
    port = free_port("127.0.0.1")
    with server_process([sys.executable, __file__, str(port)], f"http://127.0.0.1:{port}/health", 60) as (process, _):
        yield process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def judge_url():
    with fake_judge() as (_, url):
        yield url


def request(question, response, answer="42"):
    return EnvRequest(
        messages=[{"role": "user", "content": question}, {"role": "assistant", "content": response}],
        record={"answer": answer},
    )


def chat_env(url, **overrides):
    config = dict(mode="chat", url=f"{url}/v1", model="judge", prompt_template=RUBRIC, retry_backoff_s=0.05)
    return JudgeEnv(JudgeEnvConfig(**{**config, **overrides}))


def test_config_errors_name_the_field_and_the_fix():
    JudgeEnvConfig()  # the default section is valid: the fields a mode needs are checked when the env is built
    with pytest.raises(ConfigError, match="env.judge.model must be set when env.judge.mode=chat"):
        JudgeEnv(JudgeEnvConfig(url="http://127.0.0.1:1/v1"))
    with pytest.raises(
        ValidationError, match="placeholder {answer}.*{question}, {response}, {reference}, {conversation}"
    ):
        JudgeEnvConfig(prompt_template="Grade {answer}")
    with pytest.raises(ValidationError, match="has 2 groups; it needs exactly one"):
        JudgeEnvConfig(score_pattern=r"(\d+)/(\d+)")
    with pytest.raises(ValidationError, match="must be the base URL"):
        JudgeEnvConfig(url="http://127.0.0.1:8000/v1/chat/completions")
    JudgeEnvConfig(prompt_template='JSON like {{"score": N}} for {response}')  # doubled braces are literal


def test_the_rubric_is_filled_in_exactly_and_the_last_score_in_range_becomes_the_reward(judge_url):
    env = chat_env(
        judge_url, system_prompt="You are a strict grader.", failure_reward=0.25, temperature=0.0, max_tokens=64
    )
    before = len(httpx.get(f"{judge_url}/received").json())
    requests = [
        request("What is 6 x 7?", "6 x 7 = 42"),
        request("What is 6 x 8?", "It is 47", answer="48"),
        request("Say {hi}", "GARBLE {braces} stay literal"),
        request("Q", "OUTOFRANGE"),
    ]
    responses = env.step(requests)

    assert [r.reward for r in responses] == [1.0, 0.0, 0.25, 0.25]
    assert [r.info["judge_score"] for r in responses] == [10.0, 0.0, None, None]
    assert responses[0].info["judge_output"] == "Draft [[5]]. Final: [[10]]"
    received = httpx.get(f"{judge_url}/received").json()[before:]
    expected_user_messages = [
        "Question: What is 6 x 7?\nReference: 42\nResponse: 6 x 7 = 42",
        "Question: What is 6 x 8?\nReference: 48\nResponse: It is 47",
        "Question: Say {hi}\nReference: 42\nResponse: GARBLE {braces} stay literal",
        "Question: Q\nReference: 42\nResponse: OUTOFRANGE",
    ]
    assert sorted(body["messages"][1]["content"] for body in received) == sorted(expected_user_messages)
    for body in received:
        assert body["messages"][0] == {"role": "system", "content": "You are a strict grader."}
        assert (body["model"], body["temperature"], body["max_tokens"], len(body["messages"])) == ("judge", 0.0, 64, 2)
    metrics = env.metrics()
    assert {k: metrics[k] for k in ("unparseable", "judge_errors", "retries", "calls")} == {
        "unparseable": 2.0,
        "judge_errors": 0.0,
        "retries": 0.0,
        "calls": 4.0,
    }
    assert 0 < metrics["latency_s_mean"] <= metrics["latency_s_max"] < 5
    assert env.metrics()["calls"] == 0.0  # counters reset on read
    env.close()


def test_a_score_pattern_and_range_from_config_map_scores_to_rewards(judge_url):
    # "Final: [[10]]" read by a "Final: [[N]]" pattern on a 0..20 scale is reward 0.5.
    env = chat_env(judge_url, score_pattern=r"Final: \[\[(\d+)\]\]", max_score=20)
    assert [r.reward for r in env.step([request("q", "42"), request("q", "41")])] == [0.5, 0.0]
    env.close()


def test_an_http_503_is_retried_with_backoff_until_it_succeeds(judge_url):
    env = chat_env(judge_url, max_retries=2, retry_backoff_s=0.1)
    start = time.monotonic()
    [response] = env.step([request("q", "42 FLAKY-2")])
    elapsed = time.monotonic() - start
    assert response.reward == 1.0
    assert env.metrics()["retries"] == 2.0
    assert elapsed >= 0.3  # backoffs 0.1 then 0.2
    env.close()


def test_a_judge_that_keeps_failing_leaves_its_samples_unscored_as_infrastructure_failures(judge_url):
    env = chat_env(judge_url, max_retries=2)
    ok, failed = env.step([request("q", "42"), request("q", "42 FLAKY-99")])
    assert ok.reward == 1.0 and ok.infra_failure is None
    assert failed.infra_failure == "judge" and failed.reward == 0.0  # no verdict: the rollout retries, then masks
    assert re.search(
        re.escape(f"{judge_url}/v1/chat/completions") + r".*HTTP 503.*after 3 attempts", failed.info["infra_error"]
    )
    assert env.metrics()["judge_errors"] == 1.0
    env.close()


def test_a_client_error_is_not_retried(judge_url):
    env = chat_env(judge_url, model="no-such-model", max_retries=3)
    with pytest.raises(JudgeError, match=r"HTTP 404.*does not exist.*not retried"):
        env.step([request("q", "42")])
    assert env.metrics()["retries"] == 0.0
    env.close()


def test_a_judge_slower_than_timeout_s_is_retried_then_unscored_in_bounded_time(judge_url):
    env = chat_env(judge_url, timeout_s=0.5, max_retries=2)
    start = time.monotonic()
    (response,) = env.step([request("q", "SLEEP")])
    elapsed = time.monotonic() - start
    assert response.infra_failure == "judge"
    assert re.search(
        re.escape(judge_url) + r".*ReadTimeout.*timeout_s=0.5.*after 3 attempts", response.info["infra_error"]
    )
    assert 1.5 <= elapsed < 4  # 3 attempts x 0.5 s + backoffs 0.05 + 0.1
    metrics = env.metrics()
    assert (metrics["retries"], metrics["judge_errors"]) == (2.0, 1.0)
    env.close()


def test_a_judge_killed_mid_step_fails_fast_with_infrastructure_failures_not_a_hang():
    with fake_judge() as (process, url):
        env = chat_env(url, timeout_s=30, max_retries=2, retry_backoff_s=0.1, max_concurrency=4)
        assert env.step([request("q", "42")])[0].reward == 1.0
        threading.Timer(1.0, os.killpg, (process.pid, signal.SIGKILL)).start()  # while 8 calls hang on SLEEP
        start = time.monotonic()
        responses = env.step([request("q", f"SLEEP {i}") for i in range(8)])
        elapsed = time.monotonic() - start
        assert all(r.infra_failure == "judge" for r in responses)
        assert re.search(re.escape(url) + r".*ConnectError.*after 3 attempts", responses[-1].info["infra_error"])
        assert elapsed < 5  # the kill at 1 s, then two refused reconnections 0.1 and 0.2 s apart
        assert env.metrics()["retries"] >= 2
        env.close()


# ---- reward model: over HTTP and in-process -----------------------------------------------------


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A random 2-layer Qwen2ForSequenceClassification with one label and the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("reward_model")
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(std=1.0)  # scores of order 1, so that 1e-5 is a tight tolerance
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reward_model_requests():
    """Seven conversations of different lengths (so batches are padded), one of two turns."""
    requests = [request(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}. " * (i + 1)) for i in range(6)]
    requests.append(
        EnvRequest(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4"},
            ],
            record={},
        )
    )
    return requests


def test_reward_model_over_http_in_batches_equals_the_model_in_process(reward_model_dir, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret")  # the server's --token-env, the judge's env.judge.api_key_env
    port = free_port("127.0.0.1")
    command = [
        sys.executable,
        "-m",
        "reinforge.cli",
        "serve-rm",
        str(reward_model_dir),
        "--port",
        str(port),
        "--batch-size",
        "3",
        "--token-env",
        "RM_TOKEN",
    ]
    requests = reward_model_requests()
    with server_process(command, f"http://127.0.0.1:{port}/health", 120):
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health == {"status": "ok", "model": str(reward_model_dir)}
        bad = {"conversations": [[{"role": "user"}]]}
        assert httpx.post(f"http://127.0.0.1:{port}/score", json=bad).status_code == 401  # no token
        authorized = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"http://127.0.0.1:{port}/score", json=bad, headers=authorized).status_code == 422
        url = f"http://127.0.0.1:{port}"
        config = JudgeEnvConfig(mode="reward_model", url=url, batch_size=2, max_concurrency=2, api_key_env="RM_TOKEN")
        remote = JudgeEnv(config)
        remote_scores = [r.reward for r in remote.step(requests)]
        assert remote.metrics()["calls"] == 4.0  # 7 conversations, 2 per call
        remote.close()

    batched = JudgeEnv(JudgeEnvConfig(mode="local", local_model_path=str(reward_model_dir), batch_size=7))
    one_by_one = JudgeEnv(JudgeEnvConfig(mode="local", local_model_path=str(reward_model_dir), batch_size=1))
    local_scores = [r.reward for r in batched.step(requests)]
    unpadded_scores = [r.reward for r in one_by_one.step(requests)]
    assert max(abs(a - b) for a, b in zip(remote_scores, local_scores)) < 1e-5
    assert max(abs(a - b) for a, b in zip(unpadded_scores, local_scores)) < 1e-5
    assert max(abs(s) for s in local_scores) > 0.1  # scores of order 1: the tolerance means something
    assert len(set(local_scores)) == len(local_scores)

    sigmoid = JudgeEnv(
        JudgeEnvConfig(mode="local", local_model_path=str(reward_model_dir), reward_model_transform="sigmoid")
    )
    for response, score in zip(sigmoid.step(requests), local_scores):
        assert response.reward == pytest.approx(1 / (1 + 2.718281828459045**-score), abs=1e-12)
        assert response.info["reward_model_score"] == pytest.approx(score, abs=1e-5)


# ---- vLLM's OpenAI-compatible server ------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_url():
    port = free_port("127.0.0.1")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(DEMO),
        "--served-model-name",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
        "--distributed-executor-backend",
        "uni",  # no separate worker process to start
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with server_process(command, f"http://127.0.0.1:{port}/health", 300, env=env) as (_, startup_s):
        print(f"\nvLLM OpenAI server ready after {startup_s:.1f} s")
        yield f"http://127.0.0.1:{port}/v1"


def demo_requests():
    records = [json.loads(line) for line in (ROOT / "data" / "demo" / "val.jsonl").read_text().splitlines()[:4]]
    return [
        request(record["prompt"], f"The answer is \\boxed{{{record['answer']}}}.", record["answer"])
        for record in records
    ]


def test_a_vllm_judge_round_trips_and_its_answers_parse_or_count_as_unparseable(vllm_url):
    # The demo model answers its own word problems with \boxed{N}: ask it the question and read N.
    boxed = JudgeEnv(
        JudgeEnvConfig(
            mode="chat",
            url=vllm_url,
            model="demo",
            prompt_template="{question}",
            score_pattern=r"\\boxed\{(\d+)\}",
            max_score=1000,
            max_tokens=48,
        )
    )
    responses = boxed.step(demo_requests())
    parsed = 0
    for response in responses:
        numbers = re.findall(r"\\boxed\{(\d+)\}", response.info["judge_output"])
        if numbers and int(numbers[-1]) <= 1000:
            parsed += 1
            assert response.reward == int(numbers[-1]) / 1000
        else:
            assert response.reward == 0.0
    metrics = boxed.metrics()
    assert parsed >= 1 and metrics["unparseable"] == len(responses) - parsed
    assert (metrics["calls"], metrics["judge_errors"], metrics["retries"]) == (4.0, 0.0, 0.0)
    boxed.close()

    # With the default rubric the demo model writes no [[N]]: every answer is unparseable.
    rubric = JudgeEnv(JudgeEnvConfig(mode="chat", url=vllm_url, model="demo", max_tokens=32, failure_reward=0.25))
    responses = rubric.step(demo_requests())
    assert all(r.info["judge_output"] and r.info["judge_score"] is None and r.reward == 0.25 for r in responses)
    assert rubric.metrics()["unparseable"] == 4.0
    rubric.close()


if __name__ == "__main__":  # the deterministic judge, as its own process: python test_judge_env.py PORT
    import uvicorn

    # Shut down within 1 s of SIGTERM even with a SLEEP request in flight.
    uvicorn.run(
        fake_judge_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_graceful_shutdown=1
    )
