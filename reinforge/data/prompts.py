"""Turning dataset records into tokenized prompts, and drawing them batch by batch.

A record (read by data/sources.py, its fields named by `data.columns`) is an ordinary one (its prompt text in
`prompt`) or a NeMo Gym row: a record with
`responses_create_params` (an OpenAI Responses request: `input`, `tools`, `instructions`), whose
conversation and tools are rendered with `templates.render_ids`, as the OpenAI-compatible endpoint
renders what Gym sends it. The row's other fields (e.g. `expected_call`) ride along in `record`
for its resources server's /verify (envs/gym.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from transformers import PreTrainedTokenizerBase

from reinforge.data.images import ImageInputs, image_messages, load_image, process_prompt, record_image_refs
from reinforge.data.responses_format import create_params_to_chat
from reinforge.data.sources import Row, Source, SourceConfig
from reinforge.data.templates import render_ids
from reinforge.errors import DataError


class DataConfig(SourceConfig):
    train_path: str = "data/demo/train.jsonl"
    """Training prompts: a JSONL, JSON, parquet or arrow file, a directory saved by `datasets`, or a Hugging Face
    dataset name (data/sources.py); each record with a `prompt` and its `answer` (and `task`), under the names
    `columns` gives them."""
    val_path: str | None = "data/demo/val.jsonl"
    """Held-out prompts for validation, as `train_path` (its split `val_split`); null disables validation."""
    system_prompt: str | None = None
    """Optional system message put before every prompt whose record has no system field (`columns.system`)."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template; false feeds the prompt text as it is."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after templating) are dropped from the dataset, with a count."""
    max_val_prompts: int | None = None
    """Use at most this many validation prompts (the first ones); null: all."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by `seed`)."""
    shuffle_buffer: int = Field(default=10_000, gt=0)
    """With `streaming`: training prompts are drawn at random from a buffer of this many records, refilled from
    the stream as they are drawn (seeded by `seed` and the epoch), instead of from a shuffle of the whole set;
    a larger buffer mixes better and holds more prompts in memory. The run's checks (and the environments it
    starts) see this buffer's first fill."""


GYM_ROW_KEY = "responses_create_params"  # what makes a record a NeMo Gym row


@dataclass
class Prompt:
    """One prompt ready for generation."""

    record: dict[str, Any]  # the dataset record (answer, task, ...)
    messages: list[dict[str, str]]  # the chat so far (system?, user)
    token_ids: list[int]  # the rendered prompt, ending where the assistant's reply starts
    tools: list[dict[str, Any]] | None = None  # tools offered to the policy, chat form (NeMo Gym rows)
    images: ImageInputs | None = None  # a vision-language prompt's images (data/images.py); token_ids has their tokens


def render_prompt(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    prompt_key: str = "prompt",
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    system_key: str = "system",
    processor: Any = None,
    base_dir: Path = Path("."),
) -> Prompt:
    """Render one record with the tokenizer's chat template (or as plain text).

    The system message is the record's own `system_key` field when it has one (not null), else
    `system_prompt`: the record wins, so one file can mix system prompts (e.g. "detailed thinking
    on" and "off" per record) while the global one fills in for records without. An empty string
    in the record means no system message for that record. The loader (data/sources.py) has renamed the
    user's columns (`data.columns`) to `prompt` and `system`, the defaults. A NeMo Gym row whose input starts
    with its own system (or developer) message keeps that one and gets no other. A record with images
    (data/images.py: its `images` field, paths relative to `base_dir`) is rendered by a vision-language
    model's `processor`.
    """
    if GYM_ROW_KEY in record:
        return _render_gym_row(record, tokenizer, system_prompt, use_chat_template, system_key, processor, base_dir)
    if refs := record_image_refs(record):
        return _render_image_prompt(record, refs, processor, prompt_key, system_prompt, system_key, base_dir)
    system = _system_message(record, system_prompt, system_key, str(record.get(prompt_key))[:60])
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": str(record[prompt_key])}
    ]
    if use_chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "".join(m["content"] + "\n" for m in messages)
        token_ids = tokenizer(text)["input_ids"]
    return Prompt(record=record, messages=messages, token_ids=list(token_ids))


def _render_image_prompt(
    record: dict[str, Any],
    refs: list[str],
    processor: Any,
    prompt_key: str,
    system_prompt: str | None,
    system_key: str,
    base_dir: Path,
) -> Prompt:
    if processor is None:
        raise DataError("the record has images, but the model is text-only; use a vision-language model")
    images = [load_image(ref, base_dir) for ref in refs]
    system = _system_message(record, system_prompt, system_key, str(record.get(prompt_key))[:60])
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": str(record[prompt_key])}
    ]
    token_ids, inputs = process_prompt(processor, image_messages(messages, len(images)), images)
    return Prompt(record=record, messages=messages, token_ids=token_ids, images=inputs)


def _system_message(record: dict[str, Any], system_prompt: str | None, system_key: str, shown: str) -> str | None:
    """The record's own system message, else the global one (see render_prompt)."""
    system = record.get(system_key)
    if system is None:
        system = system_prompt
    elif not isinstance(system, str):
        raise DataError(
            f"the record field {system_key!r} must be its system message as a string (or null for none), "
            f"got {type(system).__name__} in the record with prompt {shown!r}"
        )
    return system


def _render_gym_row(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    system_prompt: str | None,
    use_chat_template: bool,
    system_key: str,
    processor: Any = None,
    base_dir: Path = Path("."),
) -> Prompt:
    """A NeMo Gym row's input as chat messages; its `input_image` parts (a Gym VLM server's rows) are rendered by a
    vision-language model's `processor`."""
    messages, tools = create_params_to_chat(record[GYM_ROW_KEY])
    if not messages:
        raise DataError(f"a NeMo Gym row's {GYM_ROW_KEY}.input holds no messages")
    if not use_chat_template:
        raise DataError(
            "NeMo Gym rows (records with responses_create_params) need the chat template: "
            "set data.use_chat_template=true"
        )
    if messages[0]["role"] not in ("system", "developer"):
        system = _system_message(record, system_prompt, system_key, str(messages[0]["content"])[:60])
        messages = ([{"role": "system", "content": system}] if system else []) + messages
    if refs := record_image_refs({}, messages):
        if processor is None:
            raise DataError("the row has images, but the model is text-only; use a vision-language model")
        images = [load_image(ref, base_dir) for ref in refs]
        token_ids, inputs = process_prompt(processor, image_messages(messages, 0), images, tools)
        return Prompt(record=record, messages=messages, token_ids=token_ids, tools=tools, images=inputs)
    return Prompt(record=record, messages=messages, token_ids=render_ids(tokenizer, messages, tools), tools=tools)


def load_prompts(
    path: str, data: "DataConfig", tokenizer: PreTrainedTokenizerBase, processor: Any = None, val: bool = False
) -> list[Prompt]:
    """Read and render the prompts of `path` (`data.val_path`'s when `val`), dropping prompts longer than
    `data.max_prompt_tokens`. Each record needs a prompt (`data.columns.prompt`), or `responses_create_params` (a
    NeMo Gym row). Records with images need a vision-language model's `processor` (modeling.py, `load_processor`)."""
    source = Source.val(data, path) if val else Source.train(data, path)
    check_template(path, data, tokenizer)
    prompts = [row_prompt(row, source, data, tokenizer, processor) for row in source.rows()]
    kept = [p for p in prompts if len(p.token_ids) <= data.max_prompt_tokens]
    if not kept:
        raise DataError(
            f"{path}: every prompt is longer than data.max_prompt_tokens={data.max_prompt_tokens}; raise it"
        )
    if len(kept) < len(prompts):
        print(
            f"{path}: dropped {len(prompts) - len(kept)} of {len(prompts)} prompts longer than data.max_prompt_tokens"
        )
    return kept


def check_template(path: str, data: "DataConfig", tokenizer: PreTrainedTokenizerBase) -> None:
    if data.use_chat_template and not tokenizer.chat_template:
        raise DataError(
            f"{path}: the model's tokenizer has no chat template to render the prompts with; set "
            "data.use_chat_template=false (plain text), or use a model whose tokenizer_config.json has one"
        )


def row_prompt(
    row: Row, source: Source, data: "DataConfig", tokenizer: PreTrainedTokenizerBase, processor: Any = None
) -> Prompt:
    """One record rendered, its errors one line naming the row: a prompt string, or a NeMo Gym row."""
    record = row.record
    if GYM_ROW_KEY not in record and "prompt" not in record:
        raise source.missing_error(row, "prompt", f", nor {GYM_ROW_KEY} (a NeMo Gym row)")
    if GYM_ROW_KEY not in record and not isinstance(record["prompt"], str):
        raise DataError(
            f"{row.where}: {data.columns.prompt} must be a string (the user's message), "
            f"not {type(record['prompt']).__name__}"
        )
    try:
        return render_prompt(
            record,
            tokenizer,
            "prompt",
            data.system_prompt,
            data.use_chat_template,
            "system",
            processor,
            source.base_dir,
        )
    except DataError as exc:
        raise DataError(f"{row.where}: {exc}") from None


class PromptSampler:
    """Endless seeded draws of prompt batches: each epoch is a fresh shuffle, no prompt repeats within one.

    Its position is a plain dict (`state_dict`) so that a resumed run continues with the same prompts.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, shuffle: bool = True):
        assert prompts, "no prompts"
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self.first_ordinal = 0  # the first draw's ordinal: 0, or where a restarted data order began
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Prompt]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.prompts[self._order[self.position]])
            self.position += 1
        return batch

    @property
    def drawn(self) -> int:
        """Prompts drawn so far: the next prompt's ordinal in the data stream."""
        return self.first_ordinal + self.epoch * len(self.prompts) + self.position

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The position of `state_dict`; {"epoch": 0, "position": 0, "drawn": N} starts the order afresh with
        ordinal N (a data order restarted on another file, loops/checkpointing.py)."""
        self.epoch, self.position = state["epoch"], state["position"]
        drawn_here = self.epoch * len(self.prompts) + self.position
        self.first_ordinal = state.get("drawn", drawn_here) - drawn_here
        self._order = self._epoch_order()
