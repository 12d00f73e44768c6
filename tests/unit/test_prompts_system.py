"""A record's own system message (`data.columns.system`) in GRPO prompts, rendered with the demo tokenizer."""

import inspect
import json

import pytest

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.prompts import DataConfig, load_prompts, render_prompt
from reinforge.errors import DataError
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.paths import PROJECT_ROOT

QUESTION = "Finn has 90 stickers. He loses 12. How many stickers does he have now?"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo")))


def rendered(prompt, tokenizer) -> str:
    return tokenizer.decode(prompt.token_ids)


def test_the_records_system_message_replaces_the_global_one(tokenizer):
    record = {"prompt": QUESTION, "system": "detailed thinking on"}
    prompt = render_prompt(record, tokenizer, "prompt", "You are terse.", use_chat_template=True)
    assert prompt.messages == [
        {"role": "system", "content": "detailed thinking on"},
        {"role": "user", "content": QUESTION},
    ]
    assert rendered(prompt, tokenizer) == (
        "<|im_start|>system\ndetailed thinking on<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_records_without_one_or_with_null_get_the_global_one(tokenizer):
    for record in ({"prompt": QUESTION}, {"prompt": QUESTION, "system": None}):
        prompt = render_prompt(record, tokenizer, "prompt", "You are terse.", use_chat_template=True)
        assert prompt.messages[0] == {"role": "system", "content": "You are terse."}
        prompt = render_prompt(record, tokenizer, "prompt", None, use_chat_template=True)
        assert prompt.messages == [{"role": "user", "content": QUESTION}]


def test_an_empty_system_field_means_no_system_message_even_with_a_global_one(tokenizer):
    prompt = render_prompt(
        {"prompt": QUESTION, "system": ""}, tokenizer, "prompt", "You are terse.", use_chat_template=True
    )
    assert prompt.messages == [{"role": "user", "content": QUESTION}]
    assert rendered(prompt, tokenizer).startswith("<|im_start|>user\n")


def test_the_column_is_configurable_and_other_fields_are_ignored(tokenizer, tmp_path):
    record = {"prompt": QUESTION, "instructions": "detailed thinking off", "other": "detailed thinking on"}
    (tmp_path / "prompts.jsonl").write_text(json.dumps(record) + "\n")
    data = DataConfig(columns={"system": "instructions"})
    (prompt,) = load_prompts(str(tmp_path / "prompts.jsonl"), data, tokenizer)
    assert prompt.messages[0] == {"role": "system", "content": "detailed thinking off"}


def test_without_the_chat_template_the_system_message_is_the_first_line(tokenizer):
    prompt = render_prompt(
        {"prompt": QUESTION, "system": "detailed thinking off"}, tokenizer, "prompt", None, use_chat_template=False
    )
    assert rendered(prompt, tokenizer) == f"detailed thinking off\n{QUESTION}\n"


def test_a_system_field_that_is_not_a_string_is_a_data_error(tokenizer):
    with pytest.raises(DataError, match="the record field 'system' must be its system message as a string .* got list"):
        render_prompt(
            {"prompt": QUESTION, "system": ["detailed thinking on"]}, tokenizer, "prompt", None, use_chat_template=True
        )


def test_render_prompts_default_field_is_the_configs():
    """The loader renames the user's columns to the project's names, which are render_prompt's defaults."""
    defaults = {name: p.default for name, p in inspect.signature(render_prompt).parameters.items()}
    columns = DataConfig().columns
    assert (defaults["prompt_key"], defaults["system_key"]) == (columns.prompt, columns.system) == ("prompt", "system")


def test_the_reasoning_demo_prompts_carry_their_mode_in_the_system_message(tokenizer):
    """data/demo/reasoning_val.jsonl through the GRPO config: each prompt's system message is its record's."""
    config = load_config(PROJECT_ROOT / "configs" / "reasoning_grpo_demo.yaml", ["model.name_or_path=models/demo"])
    prompts = load_prompts(config.data.val_path, config.data, tokenizer)
    assert len(prompts) == 400
    for prompt in prompts:
        mode = prompt.record["thinking"]
        assert prompt.messages[0] == {"role": "system", "content": f"detailed thinking {mode}"}
    assert [p.record["thinking"] for p in prompts[:4]] == ["on", "off", "on", "off"]
