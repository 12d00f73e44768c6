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
