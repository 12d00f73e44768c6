"""Preference pairs: reading, the two tokenizations, batching, and the pair recipes' config checks."""

import json

import pytest
from transformers import AutoTokenizer

from reinforge.algorithms.dpo_config import DPORunConfig
from reinforge.algorithms.pairs import pair_batch
from reinforge.algorithms.rm_config import RMRunConfig
from reinforge.config.loader import load_recipe_config
from reinforge.data.preference import (
    PreferenceDataConfig,
    PreferenceRecord,
    TokenizedPair,
    load_pairs,
    read_preference_records,
    tokenize_for_policy,
    tokenize_for_reward_model,
)
from reinforge.errors import ConfigError, DataError
from reinforge.paths import PROJECT_ROOT

RECORD = PreferenceRecord(
    messages=[{"role": "user", "content": "Ann has 23 coins. She finds 48 more. How many coins does she have now?"}],
    chosen="23 + 48 = 71. The answer is \\boxed{71}.",
    rejected="23 + 48 = 61. The answer is \\boxed{61}.",
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(PROJECT_ROOT / "models" / "demo")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_pairs_batch_as_chosen_then_rejected_rows_trained_only_on_reply_tokens():
    pairs = [
        TokenizedPair([5, 6, 7], [5, 8], num_prompt_tokens=1),
        TokenizedPair([5, 9], [5, 9, 9, 9], num_prompt_tokens=1),
    ]
    batch = pair_batch(pairs, pad_token_id=0)
    assert len(batch) == 4 and batch.pair_index.tolist() == [0, 0, 1, 1]
    assert batch.chosen.tolist() == [True, False, True, False]
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [5, 8, 0, 0], [5, 9, 0, 0], [5, 9, 9, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 1, 1]]
    last_token = pair_batch(pairs, pad_token_id=0, last_token_only=True)  # a reward model's score
    assert last_token.loss_mask.tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]]


def test_policy_tokens_are_the_generation_prompt_then_the_reply_and_eos(tokenizer):
    pair = tokenize_for_policy(RECORD, tokenizer)
    prompt = tokenizer.apply_chat_template(RECORD.messages, add_generation_prompt=True, tokenize=False)
    assert pair.chosen_ids[: pair.num_prompt_tokens] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert pair.rejected_ids[: pair.num_prompt_tokens] == pair.chosen_ids[: pair.num_prompt_tokens]
    assert tokenizer.decode(pair.chosen_ids[pair.num_prompt_tokens :]) == RECORD.chosen + "<|im_end|>"
    assert pair.rejected_ids[-1] == tokenizer.eos_token_id


def test_reward_model_tokens_are_the_whole_conversation_as_the_scorer_renders_it(tokenizer):
    pair = tokenize_for_reward_model(RECORD, tokenizer)
    for reply, ids in ((RECORD.chosen, pair.chosen_ids), (RECORD.rejected, pair.rejected_ids)):
        text = tokenizer.apply_chat_template(
            RECORD.messages + [{"role": "assistant", "content": reply}], tokenize=False
        )
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(pair.chosen_ids[pair.num_prompt_tokens :]) == RECORD.chosen + "<|im_end|>\n"


def test_a_pair_may_give_a_whole_conversation_or_a_prompt_with_the_system_prompt(tmp_path):
    conversation = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "1 + 1?"}]
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"},
            {"messages": conversation, "chosen": "2", "rejected": "3"},
        ],
    )
    first, second = read_preference_records(str(path), system_prompt="Think.")
    assert first.messages == [{"role": "system", "content": "Think."}, {"role": "user", "content": "2 + 2?"}]
    assert second.messages == conversation  # used as it is: no second system prompt
    assert (second.chosen, second.rejected) == ("2", "3")


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "2 + 2?", "chosen": "4"}, r"pairs.jsonl:1: no column .rejected. \(set data.columns.rejected"),
        ({"chosen": "4", "rejected": "5"}, "pairs.jsonl:1: needs a `prompt` string or a non-empty `messages` list"),
        (
            {"prompt": "2 + 2?", "chosen": ["4"], "rejected": "5"},
            "pairs.jsonl:1: `chosen` and `rejected` must be strings",
        ),
    ],
)
def test_malformed_pairs_are_one_line_errors_naming_the_pair(tmp_path, record, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", [record])
    with pytest.raises(DataError, match=message):
        read_preference_records(str(path), system_prompt=None)


def test_pairs_longer_than_max_length_are_dropped_and_none_left_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"},
            {"prompt": "2 + 2?", "chosen": "4 " * 50, "rejected": "5"},
        ],
    )
    short = len(tokenize_for_policy(read_preference_records(str(path), None)[0], tokenizer).chosen_ids)
    kept = load_pairs(str(path), tokenizer, tokenize_for_policy, PreferenceDataConfig(max_length=short))
    assert len(kept) == 1
    with pytest.raises(DataError, match="every pair is longer than data.max_length=2"):
        load_pairs(str(path), tokenizer, tokenize_for_policy, PreferenceDataConfig(max_length=2))


def test_demo_configs_load_and_unknown_keys_suggest_the_nearest_key_of_their_own_tree():
    config = load_recipe_config(
        DPORunConfig, PROJECT_ROOT / "configs" / "dpo_demo.yaml", ["dpo.beta=0.2", "model.name_or_path=123"]
    )
    assert config.dpo.beta == 0.2 and config.model.name_or_path == "123"  # a string field keeps "123" a string
    assert load_recipe_config(RMRunConfig, PROJECT_ROOT / "configs" / "rm_demo.yaml").logging.run_dir == "runs/rm_demo"
    with pytest.raises(
        ConfigError, match="unknown config key dpo.betaa: reinforge dpo has no such setting; did you mean dpo.beta"
    ):
        load_recipe_config(DPORunConfig, None, ["dpo.betaa=0.2"])
    with pytest.raises(
        ConfigError,
        match="rm.max_step: reinforge rm has no such setting; did you mean rm.max_steps",
    ):
        load_recipe_config(RMRunConfig, None, ["rm.max_step=3"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.micro_batch_size=3"], "count sequences, two per pair"),
        (
            ["training.global_batch_size=12", "training.micro_batch_size=8"],
            "does not divide training.global_batch_size=12",
        ),
        (["training.backend=fsdp2", "training.num_workers=3"], "does not split into whole pairs"),
        (["dpo.beta=0"], "dpo.beta must be > 0"),
        (["dpo.max_steps=-1"], "config key dpo.max_steps: Input should be greater than or equal to 0"),
    ],
)
def test_inconsistent_dpo_settings_are_rejected_at_load_time_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe_config(DPORunConfig, None, overrides)
