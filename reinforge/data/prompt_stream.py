"""The RL recipes' prompt sampler under `data.streaming`: prompts rendered as they are drawn, never all held.

Each epoch reads the training set once, in order, through data/sources.py. Records fill a buffer of
`data.shuffle_buffer`; each draw takes a seeded random slot of the buffer and refills it with the stream's next
record (with `data.shuffle=false`, the slot is always the oldest: file order). So memory holds one buffer of
records, whatever the set's size, and the shuffle mixes within a buffer's span rather than across the whole set.
Prompts longer than `data.max_prompt_tokens` are skipped as they come (counted once per epoch).

Its position is what `PromptSampler`'s is (`state_dict`: epoch, prompts drawn in it, all drawn), so a resumed
run continues with the same prompts: the stream is read again from the epoch's start and the drawn ones replayed.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from transformers import PreTrainedTokenizerBase

from reinforge.data.curriculum import CurriculumConfig
from reinforge.data.prompts import DataConfig, Prompt, check_template, load_prompts, row_prompt
from reinforge.data.sources import Source
from reinforge.errors import ConfigError, DataError


class PromptStream:
    """Endless seeded draws of prompt batches from a stream (the module doc); `PromptSampler`'s interface."""

    def __init__(
        self,
        data: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int,
        seed: int,
        processor: Any = None,
    ):
        check_template(data.train_path, data, tokenizer)
        self.data, self.tokenizer, self.processor = data, tokenizer, processor
        self.source = Source.train(data, data.train_path)
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.position, self.drawn = 0, 0, 0
        self._draws = self._epoch_draws()

    def head(self) -> list[Prompt]:
        """The first buffer's prompts in file order (at most `data.shuffle_buffer`): what the run checks at start-up
        and which tasks' environments it starts."""
        prompts = []
        for prompt in self._prompts():
            prompts.append(prompt)
            if len(prompts) == self.data.shuffle_buffer:
                break
        return prompts

    def next_batch(self) -> list[Prompt]:
        batch = []
        while len(batch) < self.batch_size:
            prompt = next(self._draws, None)
            if prompt is None:  # the epoch's stream is spent
                if self.position == 0:
                    raise DataError(f"{self.data.train_path}: the stream holds no prompt to draw")
                self.epoch, self.position = self.epoch + 1, 0
                self._draws = self._epoch_draws()
                continue
            batch.append(prompt)
            self.position += 1
            self.drawn += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.drawn = state["epoch"], 0, state.get("drawn", 0)
        self._draws = self._epoch_draws()
        for _ in range(state["position"]):  # replay the epoch's draws: the same buffer, the same generator state
            next(self._draws)
            self.position += 1

    def _epoch_draws(self) -> Iterator[Prompt]:
        """One epoch's prompts in draw order: a seeded draw from the buffer, refilled from the stream."""
        rng = random.Random(self.seed * 100_003 + self.epoch)
        buffer: list[Prompt] = []
        for prompt in self._prompts(report=True):
            buffer.append(prompt)
            if len(buffer) == self.data.shuffle_buffer:
                yield self._take(buffer, rng)
        while buffer:
            yield self._take(buffer, rng)

    def _take(self, buffer: list[Prompt], rng: random.Random) -> Prompt:
        if not self.data.shuffle:
            return buffer.pop(0)
        index = rng.randrange(len(buffer))
        buffer[index], buffer[-1] = buffer[-1], buffer[index]
        return buffer.pop()

    def _prompts(self, report: bool = False) -> Iterator[Prompt]:
        """The stream's prompts in file order, the over-long ones skipped (counted at the end of a read)."""
        kept = dropped = 0
        for row in self.source.rows():
            prompt = row_prompt(row, self.source, self.data, self.tokenizer, self.processor)
            if len(prompt.token_ids) > self.data.max_prompt_tokens:
                dropped += 1
                continue
            kept += 1
            yield prompt
        if not kept:
            raise DataError(
                f"{self.data.train_path}: every prompt is longer than data.max_prompt_tokens="
                f"{self.data.max_prompt_tokens}; raise it"
            )
        if dropped and report and self.epoch == 0:
            print(
                f"{self.data.train_path}: dropped {dropped} of {kept + dropped} prompts longer than "
                f"data.max_prompt_tokens"
            )


def stream_sampler(
    data: DataConfig,
    curriculum: CurriculumConfig,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    seed: int,
    processor: Any = None,
) -> PromptStream | None:
    """The run's prompt stream under `data.streaming` (None without it); the curriculum, which needs every prompt's
    pass rate before the first draw, is refused with it."""
    if not data.streaming:
        return None
    if curriculum.prefilter or curriculum.sampler != "uniform":
        raise ConfigError(
            "data.streaming draws each prompt as it is read, but the curriculum (curriculum.prefilter, "
            "curriculum.sampler=progressive) needs every prompt's pass rate first; turn one of them off"
        )
    return PromptStream(data, tokenizer, batch_size, seed, processor)


def training_prompts(data: DataConfig, tokenizer: PreTrainedTokenizerBase, processor: Any = None) -> list[Prompt]:
    """The training prompts a start-up check looks at: all of them, or under `data.streaming` the first buffer's."""
    if data.streaming:
        return PromptStream(data, tokenizer, 1, 0, processor).head()
    return load_prompts(data.train_path, data, tokenizer, processor)
