"""Turning dataset records into tokenized prompts, and drawing them batch by batch."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


@dataclass
class Prompt:
    """One prompt ready for generation."""

    record: dict[str, Any]  # the dataset record (answer, task, ...)
    messages: list[dict[str, str]]  # the chat so far (system?, user)
    token_ids: list[int]  # the rendered prompt, ending where the assistant's reply starts


def render_prompt(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    prompt_key: str,
    system_prompt: str | None,
    use_chat_template: bool,
) -> Prompt:
    """Render one record with the tokenizer's chat template (or as plain text)."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": str(record[prompt_key])}
    ]
    if use_chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "".join(m["content"] + "\n" for m in messages)
        token_ids = tokenizer(text)["input_ids"]
    return Prompt(record=record, messages=messages, token_ids=list(token_ids))


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

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
