"""`reinforge sft`'s settings: its root config (`SFTRunConfig`) and its sections (the recipe is sft.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from reinforge.algorithms.supervised_recipe import StepsConfig, SupervisedRunConfig
from reinforge.data.sources import SourceConfig
from reinforge.logging.loggers import LoggingConfig
from reinforge.training.base import BackendConfig, TrainingConfig


class SFTDataConfig(SourceConfig):
    train_path: str = "data/demo/sft.jsonl"
    """Chats: a JSONL, JSON, parquet or arrow file, a directory saved by `datasets`, or a Hugging Face dataset name
    (data/sources.py); each record with `messages` (`columns.messages`): a list of {role, content}. The loss is on
    the assistant messages; system, user and tool messages are context. A vision-language model's chats may hold
    images (`image_url` content parts, or an `images` field; docs/vlm.md)."""
    val_path: str | None = None
    """Held-out chats for the validation loss, as `train_path` (its split `val_split`); null: hold out
    `val_fraction` of train_path."""
    val_fraction: float = 0.0
    """With no val_path: the share of train_path's chats held out for validation (a split seeded by
    `seed`); 0 with no val_path disables validation."""
    system_prompt: str | None = None
    """System message put before every chat that does not start with one."""
    max_seq_len: int = 2048
    """Longest conversation in tokens (after the chat template); also the length of a packed row."""
    truncation: Literal["right", "drop"] = "right"
    """Conversations longer than max_seq_len: `right` keeps their first max_seq_len tokens (one left with
    no assistant token is dropped); `drop` drops them. Both are counted on the console."""
    shuffle: bool = True
    """Shuffle the training chats each epoch (seeded by `seed`)."""


class SFTConfig(StepsConfig):
    random_init: bool = False
    """Start from random weights drawn from the model's config (seeded by `seed`) instead of its trained
    weights; the tokenizer is loaded as usual. The demo config trains the demo architecture this way."""


class SFTTrainingConfig(BackendConfig):
    """`training:` of SFT: the backend's settings, with micro-batches sized in tokens."""

    global_batch_size: int = Field(default=128, gt=0)
    """Conversations per optimizer step."""
    micro_batch_tokens: int = Field(default=8192, gt=0)
    """Positions in one forward/backward pass (rows x longest row, padding included); gradients
    accumulate over the micro-batches of a global batch. At least data.max_seq_len."""
    sequence_packing: bool = True
    """Lay several conversations end to end in each row of `data.max_seq_len` tokens (first-fit decreasing,
    attention kept within each conversation); false: one conversation per row, right-padded."""

    def backend_config(self) -> TrainingConfig:
        """What the backend reads: these settings, micro-batches by tokens, no prompt to share."""
        return TrainingConfig(**self.model_dump(), share_prompts=False)


class SFTRunConfig(SupervisedRunConfig):
    """The whole SFT run."""

    recipe: ClassVar[str] = "sft"

    data: SFTDataConfig = SFTDataConfig()
    """Chat files, the validation split, the length cap."""
    training: SFTTrainingConfig = SFTTrainingConfig()
    """The training backend: conversations per step, micro-batches in tokens, packing."""
    sft: SFTConfig = SFTConfig()
    """Steps, validation, the starting weights."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/sft")
    """Run directory and console output."""

    @model_validator(mode="after")
    def _check(self) -> "SFTRunConfig":
        training, sft, data = self.training, self.sft, self.data
        checks = [
            (
                training.global_batch_size % training.num_workers == 0,
                f"training.global_batch_size={training.global_batch_size} does not split over training.num_workers="
                f"{training.num_workers} ranks: set it to a multiple of {training.num_workers}",
            ),
            (data.max_seq_len > 1, "data.max_seq_len must be > 1"),
            (
                training.micro_batch_tokens >= data.max_seq_len,
                f"training.micro_batch_tokens={training.micro_batch_tokens} < data.max_seq_len={data.max_seq_len}: a "
                f"micro-batch must hold a whole row; raise it to {data.max_seq_len} or more",
            ),
            (0 <= data.val_fraction < 1, "data.val_fraction must be in [0, 1)"),
            (
                not (data.val_path and data.val_fraction > 0),
                "data.val_path and data.val_fraction are both set; validate on a file or on a held-out share: "
                "set data.val_fraction=0 or data.val_path=null",
            ),
            (
                not (sft.random_init and (self.model.lora or self.model.adapter)),
                "sft.random_init does not go with model.lora or model.adapter: an adapter belongs to trained base "
                "weights, which random_init replaces; set sft.random_init=false",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self
