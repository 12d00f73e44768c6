"""NeMo Gym rows (records with `responses_create_params`) as GRPO prompts, rendered with the demo
tokenizer, whose template knows no tools (so they are listed in the system message, Hermes style)."""

import json

import pytest

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.prompts import load_prompts, render_prompt
from reinforge.errors import DataError
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.paths import PROJECT_ROOT

TOOL = {
    "type": "function",
    "name": "get_weather",
    "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ROW = {
    "responses_create_params": {
        "input": [{"role": "developer", "content": "You help."}, {"role": "user", "content": "sf?"}],
        "tools": [TOOL],
    },
    "expected_call": {"name": "get_weather", "arguments": {"city": "San Francisco"}},
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo")))


def test_a_gym_row_renders_its_input_and_tools_and_keeps_its_own_developer_message(tokenizer):
    prompt = render_prompt(ROW, tokenizer, "prompt", "You are terse.", use_chat_template=True)
    assert prompt.messages == [{"role": "developer", "content": "You help."}, {"role": "user", "content": "sf?"}]
    assert prompt.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL["parameters"]}}]
    assert prompt.record is ROW
    assert tokenizer.decode(prompt.token_ids) == (
        "<|im_start|>system\nYou help.\n\n"
        'You may call these tools, one call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:\n'
        '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}'
        "<|im_end|>\n<|im_start|>user\nsf?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_gym_row_without_a_system_message_gets_the_records_or_the_global_one(tokenizer):
    row = {"responses_create_params": {"input": "sf?"}}
    prompt = render_prompt(row, tokenizer, "prompt", "You are terse.", use_chat_template=True)
    assert prompt.messages == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "sf?"}]
    assert prompt.tools is None
    prompt = render_prompt({**row, "system": ""}, tokenizer, "prompt", "You are terse.", use_chat_template=True)
    assert tokenizer.decode(prompt.token_ids) == "<|im_start|>user\nsf?<|im_end|>\n<|im_start|>assistant\n"


def test_load_prompts_takes_gym_rows_without_the_prompt_key_but_not_records_with_neither(tokenizer, tmp_path):
    data = load_config(None, []).data
    good = tmp_path / "rows.jsonl"
    good.write_text(json.dumps(ROW) + "\n\n" + json.dumps({"prompt": "2 + 2?"}) + "\n")
    prompts = load_prompts(str(good), data, tokenizer)
    assert [p.messages[-1]["content"] for p in prompts] == ["sf?", "2 + 2?"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROW) + "\n\n" + json.dumps({"question": "2 + 2?"}) + "\n")
    with pytest.raises(
        DataError,
        match=rf"^{bad}:3: no column 'prompt' \(set data.columns.prompt to the column holding it\), "
        r"nor responses_create_params \(a NeMo Gym row\); its columns are question$",
    ):
        load_prompts(str(bad), data, tokenizer)


def test_a_malformed_gym_row_is_a_data_error_naming_its_line(tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"responses_create_params": {"input": [{"type": "web_search_call"}]}}) + "\n")
    with pytest.raises(DataError, match=rf"^{bad}:1: Responses item not supported"):
        load_prompts(str(bad), load_config(None, []).data, tokenizer)
