"""Preference pairs: reading them, tokenizing them for a policy (DPO) or a reward model, batching them.

A pair is one record (a JSONL line, or a row of any source data/sources.py reads, its fields named by
`data.columns`), with the conversation before the answer and two assistant replies, the first preferred:

    {"prompt": "How many ...?", "chosen": "23 + 48 = 71. ...", "rejected": "23 + 48 = 61. ..."}
    {"messages": [{"role": "user", "content": "..."}, ...], "chosen": "...", "rejected": "..."}

`prompt` is one user message (after `data.system_prompt`, if set); `messages` is a whole conversation,
used as it is. `chosen` and `rejected` are plain strings. A vision-language model's pairs may hold images (an
`images` field, or `image_url` parts in `messages`; data/images.py), rendered by its processor (DPO only).

Two tokenizations, each matching how its model is used later:
- policy (DPO): the chat-templated prompt with the generation prompt, then the reply's tokens and the
  end-of-turn (eos) token, as the generation engine produces them in a GRPO rollout;
- reward model: the whole conversation rendered by the chat template and tokenized in one piece, as
  `RewardModelScorer` (and so the judge environment and the reward-model server) renders it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from reinforge.data.images import ImageInputs, image_messages, load_image, process_prompt, record_image_refs
from reinforge.data.sources import Source, SourceConfig
from reinforge.errors import DataError


class PreferenceDataConfig(SourceConfig):
    train_path: str = "data/demo/preference_train.jsonl"
    """Training pairs: a JSONL, JSON, parquet or arrow file, a directory saved by `datasets`, or a Hugging Face
    dataset name (data/sources.py); each record with `prompt` (or `messages`), `chosen`, `rejected`, under the
    names `columns` gives them."""
    val_path: str | None = "data/demo/preference_val.jsonl"
    """Held-out pairs for the val/ metrics, as `train_path` (its split `val_split`); null disables validation."""
    system_prompt: str | None = None
    """Optional system message put before the `prompt` of every pair (`messages` pairs are used as they are)."""
    max_length: int = 1024
    """Pairs whose longer sequence (prompt and reply, after the chat template) exceeds this many tokens
    are dropped from the dataset, with a count."""
    max_val_pairs: int | None = None
    """Use at most this many held-out pairs (the first ones); null: all."""
    shuffle: bool = True
    """Shuffle the training pairs each epoch (seeded by `seed`)."""


@dataclass
class PreferenceRecord:
    """One pair as read from the file."""

    messages: list[dict[str, Any]]  # the conversation before the reply
    chosen: str  # the preferred assistant reply
    rejected: str  # the other one
    images: list[str] = field(default_factory=list)  # image references (data/images.py), relative to base_dir
    leading_images: int = 0  # of them, those of an `images` field: shown before the first user message's text
    base_dir: Path = Path(".")
    where: str = ""  # "FILE:LINE" or "SOURCE: row N" (data/sources.py), for errors


@dataclass
class TokenizedPair:
    """Both sequences of a pair, each the whole conversation followed by its reply."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    num_prompt_tokens: int  # leading tokens the two share before the replies; never trained on
    images: ImageInputs | None = None  # the prompt's images (a vision-language model's pair)


def read_preference_records(
    path: str, system_prompt: str | None, data: SourceConfig | None = None, val: bool = False
) -> list[PreferenceRecord]:
    """Every pair of `path` (`data.val_path`'s split when `val`), checked: a `prompt` string or a `messages` list,
    and string replies."""
    data = data or SourceConfig()
    source = Source.val(data, path) if val else Source.train(data, path)
    records = []
    for row in source.rows():
        raw, where = row.record, row.where
        for key in ("chosen", "rejected"):
            if key not in raw:
                raise source.missing_error(row, key)
        if not all(isinstance(raw[key], str) for key in ("chosen", "rejected")):
            raise DataError(f"{where}: `chosen` and `rejected` must be strings (the assistant's replies)")
        if isinstance(raw.get("messages"), list) and raw["messages"]:
            messages = raw["messages"]
        elif isinstance(raw.get("prompt"), str):
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
                {"role": "user", "content": raw["prompt"]}
            ]
        else:
            raise DataError(
                f"{where}: needs a `prompt` string or a non-empty `messages` list (the conversation before the reply)"
            )
        try:
            refs = record_image_refs(raw, messages)
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None
        leading = len(refs) if {"images", "image"} & raw.keys() else 0
        records.append(
            PreferenceRecord(messages, raw["chosen"], raw["rejected"], refs, leading, source.base_dir, where)
        )
    return records


def tokenize_for_policy(
    record: PreferenceRecord, tokenizer: PreTrainedTokenizerBase, processor: Any = None
) -> TokenizedPair:
    """Prompt (with the generation prompt) + reply tokens + eos, as the policy generates them; a pair with images
    has its prompt rendered by the `processor`, as GRPO's image prompts are (data/prompts.py)."""
    inputs = None
    if record.images:
        images = [load_image(ref, record.base_dir) for ref in record.images]
        prompt_ids, inputs = process_prompt(processor, image_messages(record.messages, record.leading_images), images)
    else:
        prompt_text = tokenizer.apply_chat_template(record.messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])

    def reply(text: str) -> list[int]:
        return prompt_ids + list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]

    return TokenizedPair(reply(record.chosen), reply(record.rejected), len(prompt_ids), inputs)


def tokenize_for_reward_model(
    record: PreferenceRecord, tokenizer: PreTrainedTokenizerBase, processor: Any = None
) -> TokenizedPair:
    """Each whole conversation through the chat template, tokenized in one piece (RewardModelScorer's rendering)."""
    if record.images:
        raise DataError("reward models on image pairs are not supported yet; give text pairs")

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    chosen_ids = render(record.messages + [{"role": "assistant", "content": record.chosen}], False)
    rejected_ids = render(record.messages + [{"role": "assistant", "content": record.rejected}], False)
    # Where the prompt ends: a template may tokenize the boundary differently in one piece, so at most
    # where the two sequences first differ.
    shared = next(
        (i for i, (a, b) in enumerate(zip(chosen_ids, rejected_ids)) if a != b), min(len(chosen_ids), len(rejected_ids))
    )
    return TokenizedPair(chosen_ids, rejected_ids, num_prompt_tokens=min(len(render(record.messages, True)), shared))


Tokenize = Callable[[PreferenceRecord, PreTrainedTokenizerBase, Any], TokenizedPair]


def load_pairs(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    tokenize: Tokenize,
    config: PreferenceDataConfig,
    processor: Any = None,
    val: bool = False,
) -> list[TokenizedPair]:
    """Read and tokenize the pairs of `path` (`data.val_path`'s when `val`), dropping pairs longer than
    `data.max_length`; pairs with images need a vision-language model's `processor`."""
    pairs = []
    for record in read_preference_records(path, config.system_prompt, config, val):
        try:
            if record.images and processor is None:
                raise DataError("the pair has images, but the model is text-only; use a vision-language model")
            pairs.append(tokenize(record, tokenizer, processor))
        except DataError as exc:
            raise DataError(f"{record.where}: {exc}") from None
    kept = [p for p in pairs if max(len(p.chosen_ids), len(p.rejected_ids)) <= config.max_length]
    if not kept:
        raise DataError(f"{path}: every pair is longer than data.max_length={config.max_length} tokens; raise it")
    if len(kept) < len(pairs):
        print(f"{path}: dropped {len(pairs) - len(kept)} of {len(pairs)} pairs longer than data.max_length")
    return kept


def num_reply_tokens(pairs: list[TokenizedPair]) -> dict[str, int]:
    """Reply tokens of the chosen and of the rejected sequences: normalisers of token-mean terms."""
    return {
        "chosen": sum(len(p.chosen_ids) - p.num_prompt_tokens for p in pairs),
        "rejected": sum(len(p.rejected_ids) - p.num_prompt_tokens for p in pairs),
    }
