"""The embedded demo model (models/demo) and its data (data/demo), built by scripts/build_demo_model.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "demo"
DATA_DIR = ROOT / "data" / "demo"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_committed_model_loads_as_a_small_qwen2_without_custom_code():
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        128,
        4,
        2,
        2,
    )
    assert config.hidden_size // config.num_attention_heads == 64  # a head size vLLM's CPU attention supports
    assert config.tie_word_embeddings
    assert model.dtype == torch.float32
    size = sum(path.stat().st_size for path in MODEL_DIR.iterdir())
    assert size <= 20 * 2**20


def test_chat_template_renders_qwen_style_prompt(tokenizer):
    messages = [{"role": "user", "content": "Ann has 23 coins."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nAnn has 23 coins.<|im_end|>\n<|im_start|>assistant\n"


def test_eos_is_im_end_and_config_generation_config_and_tokenizer_agree(tokenizer):
    config = AutoModelForCausalLM.from_pretrained(MODEL_DIR).config
    generation_config = GenerationConfig.from_pretrained(MODEL_DIR)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert config.eos_token_id == generation_config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in tokenizer.all_special_ids


def test_task_text_round_trips_and_digits_are_single_tokens(tokenizer):
    texts = [record["prompt"] for record in read_jsonl(DATA_DIR / "val.jsonl")]
    texts.append("23 + 48 = 71. 71 - 15 = 56. The answer is \\boxed{56}.")
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("1234")) == ["1", "2", "3", "4"]


def test_every_data_line_has_prompt_answer_and_task_and_splits_are_disjoint():
    splits = {name: read_jsonl(DATA_DIR / f"{name}.jsonl") for name in ("train", "val")}
    assert len(splits["val"]) == 200
    for records in splits.values():
        for record in records:
            assert set(record) == {"prompt", "answer", "task"}
            assert record["answer"].isdigit() and record["task"] == "math"
    assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["val"]}
    for chat in read_jsonl(DATA_DIR / "sft.jsonl")[:100]:
        assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
        assert "\\boxed{" in chat["messages"][1]["content"]


def test_quick_build_produces_a_loadable_model_that_generates(tmp_path):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "build_demo_model.py"),
            "--quick",
            "--out-model",
            str(tmp_path / "model"),
            "--out-data",
            str(tmp_path / "data"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    prompt = read_jsonl(tmp_path / "data" / "val.jsonl")[0]["prompt"]
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    output = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    assert output.shape == (1, input_ids.shape[1] + 4) or output[0, -1] == tokenizer.eos_token_id
    assert (tmp_path / "model" / "README.md").exists()
