"""Every outside failure is infrastructure, never the policy's reward (docs/reliability.md): a judge, an env
server, a NeMo Gym resources server or agent that answers 503 for a while, trickles its answer, answers 429 or
something other than JSON. Each is a real HTTP server on 127.0.0.1 (tests/unit/_scripted_http.py) with deadlines of
a second or two: retried, then an infrastructure failure (retried and masked by the rollout), never a score; what
is the policy's (a tool called with bad arguments) or the configuration's (a judge's 401) stays so."""

import asyncio
import json
import time

import httpx
import pytest
from _scripted_http import Reply, down_until, scripted_server

from reinforge.data.responses_format import create_params_to_chat
from reinforge.envs.base import EnvRequest
from reinforge.envs.gym import GymResourcesEnv
from reinforge.envs.gym_config import GymResourcesConfig
from reinforge.envs.http_client import RemoteEnvironment
from reinforge.envs.judge import JudgeEnv, JudgeEnvConfig, JudgeError
from reinforge.rollout.agent_runners import GymAgentRunner

SLACK_S = 2.0  # thread start-up and scheduling on a busy 2-core machine


def verdict(score: int) -> Reply:
    return Reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"[[{score}]]"}}]})


def judge(url: str, **overrides) -> JudgeEnv:
    config = {"mode": "chat", "url": f"{url}/v1", "model": "judge", "retry_backoff_s": 0.05, **overrides}
    return JudgeEnv(JudgeEnvConfig(**config))


def samples(count: int) -> list[EnvRequest]:
    return [
        EnvRequest(
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}],
            record={"answer": "42"},
        )
        for i in range(count)
    ]


def test_a_judge_down_for_less_than_its_deadline_is_retried_and_every_sample_scored():
    with scripted_server(down_until(0.6, lambda *_: verdict(10))) as url:
        env = judge(url, deadline_s=3.0, max_retries=30, retry_backoff_s=0.1)
        responses = env.step(samples(4))
    assert [(r.reward, r.infra_failure) for r in responses] == [(1.0, None)] * 4
    metrics = env.metrics()
    assert metrics["retries"] >= 4 and metrics["judge_errors"] == 0.0
    env.close()


def test_a_judge_down_past_its_deadline_leaves_its_samples_unscored_as_infra_failures_then_scores_again():
    """503 for 1.5 s, a 0.5 s deadline: every sample of the first step is an infrastructure failure within about
    0.5 s (none scored 0); once the judge is back, the same env scores for real."""
    with scripted_server(down_until(1.5, lambda *_: verdict(10))) as url:
        env = judge(url, deadline_s=0.5, max_retries=50, max_concurrency=4)
        started = time.monotonic()
        responses = env.step(samples(4))
        seconds = time.monotonic() - started
        assert all(r.infra_failure == "judge" for r in responses)
        assert seconds < 0.5 + SLACK_S
        assert "HTTP 503" in responses[0].info["infra_error"] and "deadline_s=0.5" in responses[0].info["infra_error"]
        assert env.metrics()["judge_errors"] == 4.0
        time.sleep(max(0.0, 1.7 - (time.monotonic() - started)))
        assert [r.reward for r in env.step(samples(2))] == [1.0, 1.0]
    env.close()


def test_a_judge_that_trickles_its_answer_is_cut_off_at_the_deadline():
    """A byte every 0.1 s (about 10 s for the answer), each gap well within timeout_s: only the total deadline ends
    it."""
    with scripted_server(lambda *_: Reply(**{**verdict(10).__dict__, "trickle_s": 0.1})) as url:
        env = judge(url, timeout_s=5.0, deadline_s=1.0, max_retries=3)
        started = time.monotonic()
        (response,) = env.step(samples(1))
        seconds = time.monotonic() - started
    assert response.infra_failure == "judge" and "still arriving" in response.info["infra_error"]
    assert 1.0 <= seconds < 1.0 + SLACK_S
    env.close()


def test_a_judge_answering_429_is_asked_again_after_its_retry_after():
    answers = iter([Reply(429, {"error": "slow down"}, headers=(("Retry-After", "1"),))])

    def script(*_):
        return next(answers, verdict(5))

    with scripted_server(script) as url:
        env = judge(url, deadline_s=10.0, retry_backoff_s=0.01)
        started = time.monotonic()
        (response,) = env.step(samples(1))
        seconds = time.monotonic() - started
    assert (response.reward, response.infra_failure) == (0.5, None)
    assert 1.0 <= seconds < 1.0 + SLACK_S  # the server's 1 s, not the 0.01 s backoff
    env.close()


def test_a_judge_answering_html_is_retried_then_infra_and_a_401_is_one_line_configuration_error():
    with scripted_server(lambda *_: Reply(200, b"<html>502 Bad Gateway</html>")) as url:
        env = judge(url, max_retries=1)
        (response,) = env.step(samples(1))
        assert response.infra_failure == "judge" and "not JSON" in response.info["infra_error"]
        assert env.metrics()["retries"] == 1.0
        env.close()
    with scripted_server(lambda *_: Reply(401, {"error": "invalid api key"})) as url:
        env = judge(url, max_retries=3)
        with pytest.raises(JudgeError, match=r"refused a request: HTTP 401.*invalid api key.*not retried") as error:
            env.step(samples(3))
        assert "\n" not in str(error.value) and env.metrics()["retries"] == 0.0
        env.close()


def test_an_env_server_that_trickles_or_answers_429_is_retried_within_its_deadline():
    slow = {"responses": [{"reward": 1.0}]}
    with scripted_server(lambda *_: Reply(200, slow, trickle_s=0.2)) as url:
        env = RemoteEnvironment(
            url, token=None, timeout_s=5.0, max_retries=5, backoff_s=0.0, batch_size=1, deadline_s=1
        )
        started = time.monotonic()
        (response,) = env.step(samples(1))
        assert response.infra_failure == "timeout" and "still arriving" in response.info["infra_error"]
        assert time.monotonic() - started < 1.0 + SLACK_S
        env.close()
    busy = iter([Reply(429, {"detail": "busy"}, headers=(("Retry-After", "0.3"),))])
    with scripted_server(lambda *_: next(busy, Reply(200, slow))) as url:
        env = RemoteEnvironment(url, token=None, timeout_s=5.0, max_retries=1, backoff_s=0.0, batch_size=1)
        assert [(r.reward, r.infra_failure) for r in env.step(samples(1))] == [(1.0, None)]
        env.close()


# NeMo Gym: a resources server's 5xx on a tool call is the server's; a 422 is the policy's bad call.

ROW = {
    "responses_create_params": {
        "input": "What is the weather in Paris?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    }
}


def resources_server(weather):
    """seed_session sets a cookie, get_weather answers as `weather(count)` says (count: its calls so far), verify
    gives reward 1."""
    calls = []

    def script(method, path, body):
        if path == "/seed_session":
            return Reply(200, {}, headers=(("Set-Cookie", "session=s1"),))
        if path == "/verify":
            return Reply(200, {"reward": 1.0})
        calls.append(body)
        return weather(len(calls))

    return script


def tool_turn(arguments: dict, episode_id: str) -> EnvRequest:
    messages = list(create_params_to_chat(ROW["responses_create_params"])[0])
    text = "<tool_call>" + json.dumps({"name": "get_weather", "arguments": arguments}) + "</tool_call>"
    return EnvRequest(messages=messages + [{"role": "assistant", "content": text}], record=ROW, episode_id=episode_id)


def gym(url: str, **overrides) -> GymResourcesEnv:
    return GymResourcesEnv(GymResourcesConfig(**{"url": url, "timeout_s": 5.0, "backoff_s": 0.05, **overrides}))


def test_a_gym_tool_answering_500_is_retried_then_infra_and_a_422_is_the_policys_observation():
    sunny = Reply(200, {"weather": "sunny"})
    with scripted_server(resources_server(lambda n: Reply(500, {"detail": "boom"}) if n <= 2 else sunny)) as url:
        env = gym(url, max_retries=3)
        (recovered,) = env.step([tool_turn({"city": "Paris"}, "e1")])
        assert recovered.observation == [{"role": "tool", "content": '{"weather": "sunny"}'}]
        env.close()
    with scripted_server(resources_server(lambda n: Reply(500, {"detail": "boom"}))) as url:
        env = gym(url, max_retries=2)
        (broken,) = env.step([tool_turn({"city": "Paris"}, "e2")])
        assert broken.infra_failure == "gym_server" and broken.observation is None
        assert "POST /get_weather after 3 attempts: HTTP 500" in broken.info["infra_error"]
        env.close()
    invalid = Reply(422, {"detail": [{"loc": ["body", "city"], "type": "missing"}]})
    with scripted_server(resources_server(lambda n: invalid)) as url:
        env = gym(url, max_retries=3)
        (bad_call,) = env.step([tool_turn({}, "e3")])
        assert bad_call.infra_failure is None and '"missing"' in bad_call.observation[0]["content"]
        assert env.metrics()["tool_errors"] == 1.0
        env.close()


# A NeMo Gym agent: 429 is asked again after its Retry-After; an answer that is not JSON is infrastructure.


def run_agent(url: str, max_retries: int = 2):
    async def run():
        async with httpx.AsyncClient() as client:
            return await GymAgentRunner("weather", url, 5.0, max_retries=max_retries, backoff_s=0.01).run(client, {})

    return asyncio.run(run())


def test_a_gym_agent_answering_429_is_retried_after_retry_after_and_non_json_is_infrastructure():
    busy = Reply(429, {"detail": "busy"}, headers=(("Retry-After", "0.5"),))
    answers = iter([busy])
    with scripted_server(lambda *_: next(answers, Reply(200, {"reward": 1.0}))) as url:
        started = time.monotonic()
        result = run_agent(url)
        assert (result.status, result.reward, result.infra_failure) == ("ok", 1.0, None)
        assert time.monotonic() - started >= 0.5
    with scripted_server(lambda *_: busy) as url:
        result = run_agent(url, max_retries=1)
        assert result.infra_failure == "gym_server" and "too busy after 2 attempts: HTTP 429" in result.error
    with scripted_server(lambda *_: Reply(200, b"<html>upstream error</html>")) as url:
        result = run_agent(url)
        assert result.infra_failure == "gym_server" and "other than JSON" in result.error


def test_env_score_writes_a_judge_failure_as_no_score_and_exits_as_infrastructure(tmp_path):
    """`reinforge env score` with a judge that stays down: the records are written with reward null and the command
    ends with the infrastructure failure's one line (exit 75), never a mean that counts them as 0."""
    import argparse

    from reinforge.data.jsonl import read_jsonl
    from reinforge.envs.cli import add_env_commands
    from reinforge.errors import InfrastructureError

    source, scored = tmp_path / "answers.jsonl", tmp_path / "scored.jsonl"
    source.write_text(json.dumps({"prompt": "q", "response": "42", "answer": "42"}) + "\n")
    parser = argparse.ArgumentParser()
    add_env_commands(parser.add_subparsers())
    with scripted_server(lambda *_: Reply(503, {"error": "down"})) as url:
        overrides = [f"judge.url={url}/v1", "judge.model=judge", "judge.max_retries=1", "judge.retry_backoff_s=0"]
        command = ["env", "score", "--env", "judge", "--input", str(source), "--output", str(scored), *overrides]
        args = parser.parse_args(command)
        with pytest.raises(InfrastructureError, match=r"1 of 1 records have no score \(judge: .*HTTP 503"):
            args.run(args)
    (row,) = read_jsonl(scored)
    assert row["reward"] is None and row["infra_failure"] == "judge"


def test_a_reinforge_env_served_the_gym_way_answers_503_for_a_sample_it_could_not_score():
    """Gym's verify answer has no field for "no verdict": a judge that failed is a 503 (the caller retries), never a
    reward of 0 in a 200."""
    from fastapi.testclient import TestClient

    from reinforge.envs.gym_server import build_gym_app

    row = {
        "responses_create_params": {"input": "What is 6 x 7?"},
        "response": {
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "42"}]}]
        },
        "answer": "42",
    }
    with scripted_server(lambda *_: Reply(503, {"error": "down"})) as url:
        env = judge(url, max_retries=0)
        with TestClient(build_gym_app(env, token=None, max_request_bytes=1 << 20)) as client:
            answer = client.post("/verify", json=row)
        env.close()
    assert answer.status_code == 503 and "could not score this: judge" in answer.json()["detail"]
