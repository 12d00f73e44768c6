import pydantic
import pytest

from reinforge.envs.base import EnvRequest
from reinforge.envs.format_env import (
    FormatEnv,
    FormatEnvConfig,
    thinking_mode,
    thinking_off_violation,
    thinking_on_violation,
)
from reinforge.errors import DataError


def request(response: str, system: str | None = None, **record) -> EnvRequest:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages += [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": response}]
    return EnvRequest(messages=messages, record=record)


# thinking on


def test_a_think_block_then_an_answer_follows_thinking_on():
    assert thinking_on_violation("<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.") is None
    assert thinking_on_violation("\n <think>2 + 2 = 4</think>4") is None  # leading whitespace is allowed


def test_thinking_on_without_think_tags_fails():
    assert thinking_on_violation("The answer is 4.") == "no <think> at the start"


def test_text_before_the_think_block_fails():
    assert thinking_on_violation("Sure! <think>2 + 2 = 4</think>4") == "text before <think>"


def test_a_missing_closing_tag_fails():
    assert thinking_on_violation("<think>2 + 2 = 4, so the answer is 4.") == "no closing </think>"


def test_an_empty_think_block_fails():
    assert thinking_on_violation("<think>\n\n</think>The answer is 4.") == "empty think block"


def test_no_answer_after_the_think_block_fails():
    assert thinking_on_violation("<think>2 + 2 = 4</think>\n  ") == "no answer after </think>"


def test_a_second_think_block_fails():
    response = "<think>2 + 2 = 4</think>Hmm. <think>check again</think>The answer is 4."
    assert thinking_on_violation(response) == "more than one think block"


def test_a_stray_closing_tag_after_the_block_fails():
    assert thinking_on_violation("<think>2 + 2 = 4</think>4</think>") == "more than one think block"


def test_a_nested_opening_tag_fails():
    assert thinking_on_violation("<think>a <think>b</think>4") == "nested <think>"


def test_tags_are_case_sensitive():
    assert thinking_on_violation("<THINK>2 + 2 = 4</THINK>4") == "no <think> at the start"


# thinking off


def test_a_plain_answer_follows_thinking_off():
    assert thinking_off_violation("The answer is 4.") is None


def test_any_think_tag_fails_thinking_off():
    assert thinking_off_violation("<think>2 + 2 = 4</think>4") == "think tag with thinking off"
    assert thinking_off_violation("<think></think>4") == "think tag with thinking off"
    assert thinking_off_violation("4, as I said </think>") == "think tag with thinking off"


def test_a_blank_answer_fails_thinking_off():
    assert thinking_off_violation(" \n") == "empty response"


# the mode


def test_the_mode_comes_from_the_system_message_in_any_case():
    assert thinking_mode(request("4", system="detailed thinking on")) == "on"
    assert thinking_mode(request("4", system="You are helpful.\nDetailed thinking OFF")) == "off"
    assert thinking_mode(request("4", system="You are helpful.")) is None
    assert thinking_mode(request("4")) is None


def test_a_user_message_does_not_switch_the_mode():
    messages = [{"role": "user", "content": "detailed thinking on"}, {"role": "assistant", "content": "4"}]
    assert thinking_mode(EnvRequest(messages=messages, record={})) is None


def test_the_records_thinking_field_takes_precedence_over_the_system_message():
    assert thinking_mode(request("4", system="detailed thinking on", thinking="off")) == "off"
    assert thinking_mode(request("4", thinking="on")) == "on"


def test_an_invalid_thinking_field_is_a_data_error():
    with pytest.raises(DataError, match="'thinking' must be 'on' or 'off', got True"):
        thinking_mode(request("4", thinking=True))


def test_contradictory_system_switches_are_a_data_error():
    messages = [
        {"role": "system", "content": "detailed thinking on"},
        {"role": "system", "content": "detailed thinking off"},
        {"role": "assistant", "content": "4"},
    ]
    with pytest.raises(DataError, match="both"):
        thinking_mode(EnvRequest(messages=messages, record={}))


# the environment


def test_rewards_are_one_for_compliant_and_zero_for_violating_responses():
    env = FormatEnv(FormatEnvConfig())
    responses = env.step(
        [
            request("<think>2 + 2 = 4</think>4", system="detailed thinking on"),
            request("4", system="detailed thinking on"),
            request("4", system="detailed thinking off"),
            request("<think>hm</think>4", system="detailed thinking off"),
        ]
    )
    assert [r.reward for r in responses] == [1.0, 0.0, 1.0, 0.0]
    assert responses[1].info == {"mode": "on", "violation": "no <think> at the start"}
    assert responses[2].info == {"mode": "off", "violation": None}


def test_without_a_switch_the_reward_is_configurable():
    assert FormatEnv(FormatEnvConfig()).step([request("anything")])[0].reward == 1.0
    env = FormatEnv(FormatEnvConfig(no_switch_reward=0.0))
    [response] = env.step([request("<think>x</think>y")])
    assert (response.reward, response.info) == (0.0, {"mode": None})


def test_no_switch_reward_must_lie_in_zero_to_one():
    with pytest.raises(pydantic.ValidationError, match="no_switch_reward"):
        FormatEnvConfig(no_switch_reward=2.0)


def test_metrics_give_compliance_per_mode_since_the_last_call():
    env = FormatEnv(FormatEnvConfig())
    env.step(
        [
            request("<think>a</think>b", system="detailed thinking on"),
            request("<think>a</think>", system="detailed thinking on"),
            request("b", system="detailed thinking on"),
            request("b", system="detailed thinking off"),
            request("b"),
        ]
    )
    assert env.metrics() == {
        "compliance_rate/thinking_on": 1 / 3,
        "compliance_rate/thinking_off": 1.0,
        "no_switch": 1.0,
    }
    assert env.metrics() == {"no_switch": 0.0}


def test_the_response_is_the_last_assistant_message():
    env = FormatEnv(FormatEnvConfig())
    messages = [
        {"role": "system", "content": "detailed thinking off"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>oops</think>4"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "4"},
    ]
    assert env.step([EnvRequest(messages=messages, record={})])[0].reward == 1.0
