"""Turning dataset records into tokenized prompts, and drawing them batch by batch.

A record is an ordinary one (its prompt text in `data.prompt_key`) or a NeMo Gym row: a record with
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

from transformers import PreTrainedTokenizerBase

from reinforge.config.section import Section
from reinforge.data.images import ImageInputs, image_messages, load_image, process_prompt, record_image_refs
from reinforge.data.jsonl import read_jsonl
from reinforge.data.responses_format import create_params_to_chat
from reinforge.data.templates import render_ids
from reinforge.errors import DataError
from reinforge.paths import resolve_path


class DataConfig(Section):
    train_path: str = "data/demo/train.jsonl"
    """JSONL file of training prompts; one object per line with `prompt` and `answer` (and `task`)."""
    val_path: str | None = "data/demo/val.jsonl"
    """JSONL file of held-out prompts for validation; null disables validation."""
    prompt_key: str = "prompt"
    """Record field holding the user message."""
    system_prompt: str | None = None
    """Optional system message put before every prompt whose record has no `system_key` field."""
    system_key: str = "system"
    """Record field holding that record's own system message (e.g. "detailed thinking on"); when a
    record has it (not null) it replaces `system_prompt` for that record, "" meaning none."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template; false feeds the prompt text as it is."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after templating) are dropped from the dataset, with a count."""
    max_val_prompts: int | None = None
    """Use at most this many validation prompts (the first ones); null: all."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by `seed`)."""


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
    prompt_key: str,
    system_prompt: str | None,
    use_chat_template: bool,
    system_key: str = "system",
    processor: Any = None,
    base_dir: Path = Path("."),
) -> Prompt:
    """Render one record with the tokenizer's chat template (or as plain text).

    The system message is the record's own `system_key` field when it has one (not null), else
    `system_prompt`: the record wins, so one file can mix system prompts (e.g. "detailed thinking
    on" and "off" per record) while the global one fills in for records without. An empty string
    in the record means no system message for that record. The default `system_key` is
    `data.system_key`'s (`DataConfig` above). A NeMo Gym row whose input starts with its own system
    (or developer) message keeps that one and gets no other. A record with images (data/images.py: its
    `images` field, paths relative to `base_dir`) is rendered by a vision-language model's `processor`.
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
    path: str, data: "DataConfig", tokenizer: PreTrainedTokenizerBase, processor: Any = None
) -> list[Prompt]:
    """Read and render a prompt file, dropping prompts longer than `data.max_prompt_tokens`. Each record
    needs `data.prompt_key`, or `responses_create_params` (a NeMo Gym row). Records with images need a
    vision-language model's `processor` (modeling.py, `load_processor`)."""
    file = resolve_path(path)
    if data.use_chat_template and not tokenizer.chat_template:
        raise DataError(
            f"{file}: the model's tokenizer has no chat template to render the prompts with; set "
            "data.use_chat_template=false (plain text), or use a model whose tokenizer_config.json has one"
        )
    prompts = []
    for index, record in enumerate(read_jsonl(file)):
        if GYM_ROW_KEY not in record and data.prompt_key not in record:
            raise DataError(
                f"{file}:{_line_number(file, index)}: record has no {data.prompt_key} field; "
                f"every record needs {data.prompt_key} (or {GYM_ROW_KEY}, as a NeMo Gym row has)"
            )
        if GYM_ROW_KEY not in record and not isinstance(record[data.prompt_key], str):
            raise DataError(
                f"{file}:{_line_number(file, index)}: {data.prompt_key} must be a string (the user's message), "
                f"not {type(record[data.prompt_key]).__name__}"
            )
        try:
            prompts.append(
                render_prompt(
                    record,
                    tokenizer,
                    data.prompt_key,
                    data.system_prompt,
                    data.use_chat_template,
                    data.system_key,
                    processor,
                    file.parent,
                )
            )
        except DataError as exc:
            if GYM_ROW_KEY not in record and not ({"images", "image"} & record.keys()):
                raise
            raise DataError(f"{file}:{_line_number(file, index)}: {exc}") from None
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


def _line_number(path: Path, index: int) -> int:
    """The line of the `index`-th record (read_jsonl skips blank lines)."""
    with path.open(encoding="utf-8", errors="replace") as handle:  # read_jsonl has checked the encoding
        lines = [number for number, line in enumerate(handle, start=1) if line.strip()]
    return lines[index]


class PromptSampler:
    """Endless seeded draws of prompt batches: each epoch is a fresh shuffle, no prompt repeats within one.

    Its position is a plain dict (`state_dict`) so that a resumed run continues with the same prompts.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, shuffle: bool = True):
        assert prompts, "no prompts"
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
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
        return self.epoch * len(self.prompts) + self.position

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
