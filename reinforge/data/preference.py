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
from typing import Any

from reinforge.data.images import ImageInputs
from reinforge.data.sources import SourceConfig


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


def num_reply_tokens(pairs: list[TokenizedPair]) -> dict[str, int]:
    """Reply tokens of the chosen and of the rejected sequences: normalisers of token-mean terms."""
    return {
        "chosen": sum(len(p.chosen_ids) - p.num_prompt_tokens for p in pairs),
        "rejected": sum(len(p.rejected_ids) - p.num_prompt_tokens for p in pairs),
    }
