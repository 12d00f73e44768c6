"""The endpoint's prompt and message handling: the on-policy prefix splice, tool calls as OpenAI `tool_calls`."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reinforge.errors import DataError
from reinforge.serving.prompt import parse_generation, prompt_ids, splice
from reinforge.serving.protocol import ChatMessage

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ROOT / "models" / "demo")


def test_the_splice_keeps_the_sampled_tokens_and_templates_only_the_new_turn():
    """A worked example (EOS = 2): turn 1 was prompted with [11, 12, 13, 40, 41] and
    generated [220, 17, 2]; the template re-renders that reply as 1001. The spliced prompt is the required
    prefix (its EOS included), then the template after its 2nd EOS (the template prefix has 2)."""
    template_prefix = [11, 12, 13, 40, 41, 1001, 2]
    template = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]
    assert splice([11, 12, 13, 40, 41, 220, 17, 2], template, template_prefix, eos_id=2) == [
        11,
        12,
        13,
        40,
        41,
        220,
        17,
        2,
        21,
        22,
        40,
        41,
    ]


def test_a_generation_cut_by_length_gets_one_eos_before_the_new_turn():
    template_prefix = [11, 40, 1001, 2]
    template = [11, 40, 1001, 2, 21, 40]
    assert splice([11, 40, 220, 17], template, template_prefix, eos_id=2) == [11, 40, 220, 17, 2, 21, 40]


def test_counting_end_of_turn_tokens_survives_a_template_that_shortens_old_turns():
    """The template drops the old turn's content entirely (as reasoning templates drop <think> blocks):
    template prefix [11, 2, 40, 2] has 2 EOS; the template's 2nd EOS is at index 3."""
    template_prefix = [11, 2, 40, 2]
    template = [11, 2, 40, 2, 30, 2, 40]
    assert splice([11, 2, 40, 55, 56, 57, 2], template, template_prefix, eos_id=2) == [
        11,
        2,
        40,
        55,
        56,
        57,
        2,
        30,
        2,
        40,
    ]


def test_a_template_with_fewer_turns_than_the_history_cannot_be_spliced():
    with pytest.raises(DataError, match="cannot splice"):
        splice([11, 2, 40, 5, 2], [11, 2, 40, 9], [11, 2, 40, 9, 2], eos_id=2)


def test_the_next_prompt_extends_the_tokens_the_policy_sampled_even_where_the_text_re_tokenizes_differently(tokenizer):
    """The policy spelled "The" as three byte tokens; the template renders the same text as the merged
    token. Without the token fields the prompt has the merged token; with them, the sampled ones."""
    user = {"role": "user", "content": "Ann has 57 stickers."}
    first_prompt = prompt_ids(tokenizer, [ChatMessage(**user)], None)
    spelled = (
        [tokenizer.convert_tokens_to_ids(c) for c in "The"]
        + tokenizer.encode(" answer is 57.")
        + [tokenizer.eos_token_id]
    )
    merged = tokenizer.encode("The answer is 57.")
    assert tokenizer.decode(spelled[:-1]) == "The answer is 57." and spelled[:-1] != merged
    assistant = {"role": "assistant", "content": "The answer is 57."}
    follow_up = {"role": "user", "content": "Why?"}
    plain = prompt_ids(tokenizer, [ChatMessage(**m) for m in (user, assistant, follow_up)], None)
    assert plain[len(first_prompt) :][: len(merged)] == merged
    carried = ChatMessage(
        **assistant,
        prompt_token_ids=first_prompt,
        generation_token_ids=spelled,
        generation_log_probs=[0.0] * len(spelled),
    )
    spliced = prompt_ids(tokenizer, [ChatMessage(**user), carried, ChatMessage(**follow_up)], None)
    assert spliced[: len(first_prompt) + len(spelled)] == first_prompt + spelled
    assert (
        spliced[len(first_prompt) + len(spelled) :] == plain[len(first_prompt) + len(merged) + 1 :]
    )  # the same new turn


def test_tool_calls_in_the_output_come_back_as_openai_tool_calls(tokenizer):
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "57 + 34"}}</tool_call>'
    parsed = parse_generation(
        tokenizer, tokenizer.encode(text) + [tokenizer.eos_token_id], truncated=False, stop_strings=()
    )
    assert parsed.finish_reason == "tool_calls" and parsed.content == "Let me compute."
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {
        "expression": "57 + 34"
    }


def test_a_malformed_call_stays_in_the_content_and_a_stop_string_leaves_it(tokenizer):
    broken = parse_generation(
        tokenizer, tokenizer.encode("<tool_call>{not json}</tool_call>"), truncated=False, stop_strings=()
    )
    assert (broken.tool_calls, broken.content, broken.finish_reason) == (
        [],
        "<tool_call>{not json}</tool_call>",
        "stop",
    )
    stopped = parse_generation(
        tokenizer, tokenizer.encode("The answer is 5. END"), truncated=False, stop_strings=(" END",)
    )
    assert stopped.content == "The answer is 5."
    cut = parse_generation(tokenizer, tokenizer.encode("The answer"), truncated=True, stop_strings=())
    assert cut.finish_reason == "length"
