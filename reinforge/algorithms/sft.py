"""Supervised fine-tuning on chats: one loop, read top to bottom.

Each step: take the next `training.global_batch_size` conversations (a seeded shuffle per epoch); pack
them into rows of at most `data.max_seq_len` tokens and the rows into micro-batches of at most
`training.micro_batch_tokens` positions; for each micro-batch, forward, loss and backward; clip the
gradient norm; one AdamW step; advance the learning-rate schedule; validate every `sft.val_every`
steps; log.

The loss is the negative log-likelihood of the assistant tokens (content and end-of-turn, see
data/chat.py), averaged over every assistant token of the global batch:

    loss = -(1 / N) sum_{t in M} log p(x_t | x_<t),   N = |M| over the whole global batch

Every micro-batch divides by the same global N, so the accumulated gradient is that of one big
batch, however the conversations are packed or split (token-level averaging: long replies weigh more
than short ones, as in TRL and torchtune; a per-conversation mean would need a different N).

With `model.lora` only PEFT's LoRA adapters are trained (their AdamW state only) and `final/` holds the
adapter in PEFT's format (training/lora.py). The forward/backward, clipping and optimizer step go through the
training backend (training/backend.py) with the policy's LM head, in this process (`training.backend=torch`) or on
`training.num_workers` FSDP2 ranks (`fsdp2`), each training on its share of the global batch's conversations
(loops/builders.py, `build_recipe_backend`): the same gradient, so the same run.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator, Literal

import torch
from pydantic import Field, model_validator
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.algorithms.losses import token_mean
from reinforge.cluster.config import ClusterConfig
from reinforge.config.loader import save_config
from reinforge.config.section import Section
from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.data.chat import ChatExample, fit_length, render_chat
from reinforge.data.sources import Source, SourceConfig
from reinforge.errors import ConfigError, DataError
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import LoggingConfig
from reinforge.logging.metrics import JsonlWriter, Timers
from reinforge.loops.builders import build_recipe_backend
from reinforge.model_config import ModelConfig
from reinforge.modeling import (
    DTYPES,
    check_fits_context,
    load_processor,
    load_tokenizer,
    model_class,
    model_location,
    save_tokenizer,
)
from reinforge.run_dir import atomic_directory, make_run_dir
from reinforge.training import lora
from reinforge.training.backend import Backend
from reinforge.training.base import BackendConfig, TrainingConfig
from reinforge.training.checkpoint import CheckpointConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

# --- Config ------------------------------------------------------------------------------------


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


class SFTConfig(Section):
    max_steps: int = Field(default=100, ge=0)
    """Optimizer steps to run, each on `training.global_batch_size` conversations."""
    val_every: int = Field(default=50, ge=0)
    """Validation loss every this many steps (and before the first and after the last); 0: only then."""
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


class SFTRunConfig(Section):
    """The whole SFT run."""

    recipe: ClassVar[str] = "sft"

    seed: int = 0
    """Seed for the validation split, data order and (with sft.random_init) the initial weights."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (all cores). 1 avoids thread contention on a
    shared machine; the results do not depend on it."""
    model: ModelConfig = ModelConfig()
    """The model to fine-tune and its tokenizer, whose chat template renders the conversations."""
    data: SFTDataConfig = SFTDataConfig()
    """Chat files, the validation split, the length cap."""
    training: SFTTrainingConfig = SFTTrainingConfig()
    """The training backend: conversations per step, micro-batches in tokens, packing."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The learning-rate schedule over sft.max_steps."""
    sft: SFTConfig = SFTConfig()
    """Steps, validation, the starting weights."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Whether to write the trained model to RUN_DIR/final."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/sft")
    """Run directory and console output."""
    cluster: ClusterConfig = ClusterConfig()
    """With `training.backend=fsdp2`: the Ray cluster the ranks run on and each rank's resources."""

    @model_validator(mode="after")
    def _check(self) -> "SFTRunConfig":
        training, sft, data = self.training, self.sft, self.data
        checks = [
            (
                training.global_batch_size % training.num_workers == 0,
                f"training.global_batch_size={training.global_batch_size} does not split over training.num_workers="
                f"{training.num_workers} ranks: set it to a multiple of {training.num_workers}",
            ),
            (self.num_threads >= 0, "num_threads must be >= 0 (0: torch's default)"),
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
            (self.logging.console_every >= 1, "logging.console_every must be >= 1"),
            (
                not (sft.random_init and (self.model.lora or self.model.adapter)),
                "sft.random_init does not go with model.lora or model.adapter: an adapter belongs to trained base "
                "weights, which random_init replaces; set sft.random_init=false",
            ),
            (
                not (self.model.lora and self.model.lora.quantize_base != "none"),
                "model.lora.quantize_base (QLoRA) is not supported by sft; set it to none",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


# --- The loop ----------------------------------------------------------------------------------


@dataclass
class SFTResult:
    run_dir: Path
    first_val_loss: float | None
    last_val_loss: float | None


def train(config: SFTRunConfig) -> SFTResult:
    with ExitStack() as cleanup:  # the FSDP2 ranks and Ray, on every way out
        return run(config, cleanup)


def run(config: SFTRunConfig, cleanup: ExitStack) -> SFTResult:
    sft = config.sft
    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    lora.check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    tokenizer = load_tokenizer(config.model)
    check_fits_context(config.model, config.data.max_seq_len, f"data.max_seq_len={config.data.max_seq_len}")
    train_examples, val_examples = load_datasets(config, tokenizer)
    backend = build_backend(config, cleanup)
    # Only once the inputs are known to be good: a bad path never leaves a half-made run directory.
    run_dir = make_run_dir(config.logging.run_dir)
    save_config(
        config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": str(run_dir)})}),
        run_dir / "config.yaml",
    )
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    pad_id = tokenizer.pad_token_id
    val_batch = examples_batch(val_examples, pad_id) if val_examples else None
    batches = global_batches(train_examples, config.training.global_batch_size, config.seed, config.data.shuffle)
    val_history: list[float] = []

    with ConsoleLog(sft.max_steps, "SFT") as console:
        console.print(f"run directory: {run_dir}")
        num_parameters, num_trained = backend.num_parameters()
        console.print(
            f"{len(train_examples)} training / {len(val_examples)} validation conversations; "
            f"{num_parameters:,} parameters, {num_trained:,} trained"
        )
        if val_batch is not None:
            metrics = validate(backend, val_batch, console, step=0)
            val_history.append(metrics["val/loss"])
            metrics_log.write(0, metrics)

        for step in range(1, sft.max_steps + 1):
            metrics = sft_step(backend, next(batches), pad_id)
            metrics["train/epoch"] = step * config.training.global_batch_size / len(train_examples)
            if val_batch is not None and (step == sft.max_steps or (sft.val_every and step % sft.val_every == 0)):
                metrics.update(validate(backend, val_batch, console, step))
                val_history.append(metrics["val/loss"])
            metrics_log.write(step, metrics)
            console.step(step, metrics, show_line=step % config.logging.console_every == 0)

        if config.checkpoint.save_final:
            with atomic_directory(run_dir / "final") as tmp:
                backend.save_pretrained(tmp)  # with LoRA, the adapter in PEFT's format
                save_tokenizer(config.model, tmp)

    first, last = (val_history[0], val_history[-1]) if val_history else (None, None)
    if first is not None:
        console.print(f"val/loss at step 0: {first:.4f}; at step {sft.max_steps}: {last:.4f} ({last - first:+.4f})")
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}"
        + (f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else "")
    )
    return SFTResult(run_dir=run_dir, first_val_loss=first, last_val_loss=last)


def build_backend(config: SFTRunConfig, cleanup: ExitStack | None = None) -> Backend:
    """The training backend for SFT (in this process, or on FSDP2 ranks that `cleanup` stops): the policy's LM head
    at temperature 1 (from random weights with `sft.random_init`), micro-batches of `training.micro_batch_tokens`
    positions whose conversations are packed (`training.sequence_packing`) into rows of `data.max_seq_len` tokens,
    AdamW over `sft.max_steps` steps."""
    head = LogprobHead(temperature=1.0, load_model=random_model if config.sft.random_init else lora.load_policy)
    return build_recipe_backend(config, config.sft.max_steps, head, cleanup, row_tokens=config.data.max_seq_len)


def sft_step(backend: Backend, examples: list[ChatExample], pad_id: int) -> dict[str, float]:
    """One optimizer step on one global batch of conversations. Returns its metrics (an MoE's routing among them)."""
    timers = Timers()
    batch = examples_batch(examples, pad_id)
    with timers.time("step"):
        updates = backend.train_step(batch, nll_loss)
    lengths = [len(e) for e in examples]
    plan = backend.plan(lengths, None)
    num_slots = sum(len(rows) * max(sum(lengths[i] for i in row) for row in rows) for rows in plan)
    return {
        "train/loss": updates["loss"],
        "train/grad_norm": updates["grad_norm"],
        "train/lr": updates["lr"],
        "train/num_trained_tokens": batch.num_valid_tokens(),
        "train/num_micro_batches": len(plan),
        "perf/packing_efficiency": sum(lengths) / num_slots,
        "perf/tokens_per_s": sum(lengths) / timers.seconds["step"],
        **{f"train/{name}": value for name, value in updates.items() if name.startswith("moe/")},  # an MoE's routing
        **timers.metrics(),
    }


def nll_loss(logprobs_BT: torch.Tensor, micro: TrainBatch, norm: Normalisers):
    """This micro-batch's share of the global batch's mean NLL over assistant tokens."""
    loss = token_mean(-logprobs_BT, micro.loss_mask, norm)
    return loss, {"loss": loss.detach()}


def examples_batch(examples: list[ChatExample], pad_id: int) -> TrainBatch:
    """Conversations as right-padded rows, the loss on their assistant tokens (no advantages: SFT's loss has none)."""
    width = max(len(e) for e in examples)
    images = [e.images for e in examples]
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width))
    for row, example in enumerate(examples):
        input_ids[row, : len(example)] = torch.tensor(example.token_ids)
        attention_mask[row, : len(example)] = 1
        loss_mask[row, : len(example)] = torch.tensor(example.loss_mask, dtype=torch.float32)
    zeros = torch.zeros_like(loss_mask)
    return TrainBatch(
        input_ids,
        attention_mask,
        loss_mask,
        advantages=zeros,
        gen_logprobs=zeros,
        images=images if any(i is not None for i in images) else None,
    )


def validate(backend: Backend, batch: TrainBatch, console: ConsoleLog, step: int) -> dict[str, float]:
    """Mean NLL over every assistant token of the validation set (the training loss's formula)."""
    timers = Timers()
    with timers.time("val"):
        loss = backend.evaluate(batch, nll_loss)["loss"]
    console.print(f"step {step:>4} | val/loss {loss:.4f}")
    return {"val/loss": loss, **timers.metrics()}


# --- Data and model ----------------------------------------------------------------------------


def load_datasets(
    config: SFTRunConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[ChatExample], list[ChatExample]]:
    """Training and validation conversations: a validation file, or a seeded held-out share, or none."""
    data = config.data
    if tokenizer.chat_template is None:
        raise ConfigError(
            f"model.name_or_path={config.model.name_or_path}: its tokenizer has no chat template, which sft needs "
            "to find the assistant tokens"
        )
    examples = load_examples(data.train_path, config, tokenizer)
    if data.val_path:
        return examples, load_examples(data.val_path, config, tokenizer, val=True)
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    num_val = round(len(examples) * data.val_fraction)
    if data.val_fraction > 0 and not 0 < num_val < len(examples):
        raise ConfigError(
            f"data.val_fraction={data.val_fraction} of {len(examples)} conversations leaves an empty split; change it"
        )
    return [examples[i] for i in sorted(order[num_val:])], [examples[i] for i in sorted(order[:num_val])]


def load_examples(
    path: str, config: SFTRunConfig, tokenizer: PreTrainedTokenizerBase, val: bool = False
) -> list[ChatExample]:
    """Render every chat of `path` (`data.val_path`'s split when `val`), applying data.truncation to those over
    data.max_seq_len."""
    data = config.data
    source = Source.val(data, path) if val else Source.train(data, path)
    processor = load_processor(config.model)
    examples, num_too_long, records = [], 0, 0
    for row in source.rows():
        records += 1
        if "messages" not in row.record:
            raise source.missing_error(row, "messages")
        try:
            example = render_chat(row.record, tokenizer, "messages", data.system_prompt, processor, source.base_dir)
        except (KeyError, TypeError, AttributeError):
            raise DataError(
                f"{row.where}: `{data.columns.messages}` must be a list of {{role, content}} objects"
            ) from None
        except DataError as exc:
            raise DataError(f"{row.where}: {exc}") from None
        num_too_long += len(example) > data.max_seq_len
        fitted = fit_length(example, data.max_seq_len, data.truncation)
        if fitted is not None:
            examples.append(fitted)
    if not examples:
        fix = "raise it" + (" or set data.truncation=right" if data.truncation == "drop" else "")
        raise DataError(
            f"{path}: no conversation fits data.max_seq_len={data.max_seq_len} with an assistant token left; {fix}"
        )
    if num_too_long:
        action = "cut to" if data.truncation == "right" else "dropped for exceeding"
        print(
            f"{path}: {num_too_long} of {records} conversations {action} data.max_seq_len="
            f"{data.max_seq_len} tokens ({records - len(examples)} dropped in all)"
        )
    return examples


def random_model(model_config: ModelConfig) -> tuple[PreTrainedModel, None]:
    """`sft.random_init`: random weights drawn from the model's config (seeded by `seed` before it is called)."""
    hf_config = AutoConfig.from_pretrained(
        model_location(model_config), trust_remote_code=model_config.trust_remote_code
    )
    model = model_class(hf_config).from_config(
        hf_config, dtype=DTYPES[model_config.dtype], trust_remote_code=model_config.trust_remote_code
    )
    return model, None


def global_batches(
    examples: list[ChatExample], batch_size: int, seed: int, shuffle: bool
) -> Iterator[list[ChatExample]]:
    """Endless batches; each epoch is a fresh seeded shuffle, and a batch may run on into the next epoch."""
    epoch, order = 0, []
    while True:
        while len(order) < batch_size:
            indices = list(range(len(examples)))
            if shuffle:
                random.Random(seed * 100_003 + epoch).shuffle(indices)
            order, epoch = order + indices, epoch + 1
        yield [examples[i] for i in order[:batch_size]]
        order = order[batch_size:]
