"""The tool_use environment: tool calls run for real (the calculator, Python in the sandbox)."""

import pytest

from reinforge.data.tool_calls import parse_tool_calls
from reinforge.envs.base import EnvRequest
from reinforge.envs.math_env import MathEnv
from reinforge.envs.tool_use import ToolUseEnv, ToolUseEnvConfig, calculate
from reinforge.errors import ConfigError

# One xdist worker runs every test that starts sandboxes in turn: some count the live sandbox processes
# (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("sandbox")


@pytest.fixture(scope="module")
def env():
    env = ToolUseEnv(ToolUseEnvConfig(call_penalty=0.1), answer_env=MathEnv())
    yield env
    env.close()


def turn(text, answer="68"):
    return EnvRequest(
        messages=[{"role": "user", "content": "What is 23 + 45?"}, {"role": "assistant", "content": text}],
        record={"answer": answer},
    )


def call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_the_calculator_evaluates_arithmetic_exactly_and_refuses_anything_else():
    assert calculate("23 + 45") == "68"
    assert calculate("(7 - 10) * 3 / 2") == "-4.5"
    assert calculate("2 ** 10 // 3 % 7") == "5"  # 1024 // 3 = 341; 341 % 7 = 5
    for bad in ("__import__('os')", "a + 1", "2 ** 1000", "1 / 0", "[1, 2]"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_a_tool_call_is_answered_with_an_observation_and_no_reward(env):
    (response,) = env.step([turn("Let me compute. " + call("calculator", expression="23 + 45"))])
    assert not response.done and response.observation == [{"role": "tool", "content": "68"}]
    assert response.reward == pytest.approx(-0.1)  # call_penalty


def test_python_runs_in_the_sandbox_and_returns_its_output(env):
    (response,) = env.step([turn(call("python", code="print(sum(range(10)))"))])
    assert response.observation[0]["content"].strip() == "45"
    (response,) = env.step([turn(call("python", code="open('/etc/passwd_copy', 'w').write('x')"))])
    assert response.observation[0]["content"].startswith("error (failed)")


def test_malformed_and_unknown_calls_get_error_observations(env):
    before = env.metrics()
    responses = env.step(
        [turn("<tool_call>{not json}</tool_call>"), turn(call("search", query="x")), turn(call("calculator", expr="1"))]
    )
    texts = [r.observation[0]["content"] for r in responses]
    assert texts[0].startswith("error: the tool call is not valid JSON")
    assert texts[1].startswith("error: unknown tool 'search'")
    assert texts[2].startswith("error:")
    assert env.metrics()["tool_errors"] == 3 and before["tool_calls"] >= 0


def test_two_calls_in_one_turn_give_two_observations(env):
    (response,) = env.step([turn(call("calculator", expression="1+1") + call("calculator", expression="2*3"))])
    assert [m["content"] for m in response.observation] == ["2", "6"]


def test_a_turn_without_a_call_is_the_final_answer_scored_by_the_answer_env(env):
    right, wrong = env.step([turn("The answer is 68."), turn("The answer is 58.")])
    assert (right.done, right.reward, wrong.done, wrong.reward) == (True, 1.0, True, 0.0)
    assert parse_tool_calls("no calls here") == []


def test_an_unknown_tool_in_config_is_a_one_line_error():
    with pytest.raises(ConfigError, match="unknown tool 'browser'"):
        ToolUseEnv(ToolUseEnvConfig(tools=["browser"]), answer_env=MathEnv())


def test_a_sandbox_that_cannot_start_is_an_infra_failure_and_a_bad_call_stays_the_policys(env):
    """With no file descriptor left the sandbox cannot make its pipes: an OSError out of the tool, which the policy
    could do nothing about. That turn is an infrastructure failure (retried, then masked), never an observation;
    the same turn's bad call is still the policy's own error."""
    import os
    import resource

    assert env.step([turn(call("python", code="print(1)"))])[0].observation[0]["content"] == "1\n"  # probed
    env.metrics()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 1, hard))  # no room for the sandbox's pipes
    try:
        broken, bad = env.step([turn(call("python", code="print(2)")), turn(call("calculator", expression="2 +"))])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert broken.infra_failure == "sandbox" and broken.observation is None
    assert (
        "sandbox could not start" in broken.info["infra_error"] and "Too many open files" in broken.info["infra_error"]
    )
    assert bad.infra_failure is None and bad.observation[0]["content"].startswith("error: not an arithmetic expression")
    metrics = env.metrics()
    assert (metrics["tool_failures"], metrics["tool_errors"]) == (1.0, 1.0)
    (again,) = env.step([turn(call("python", code="print(2)"))])  # descriptors back: the real observation
    assert again.observation[0]["content"] == "2\n" and again.infra_failure is None
