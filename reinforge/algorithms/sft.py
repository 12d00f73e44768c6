"""Supervised fine-tuning on chats: one loop, read top to bottom.

Each step: take the next `training.global_batch_size` conversations (a seeded shuffle per epoch); pack
them into rows of at most `data.max_seq_len` tokens and the rows into micro-batches of at most
`sft.micro_batch_tokens` positions; for each micro-batch, forward, loss and backward; clip the
gradient norm; one AdamW step; advance the learning-rate schedule; validate every `sft.val_every`
steps; log.

The loss is the negative log-likelihood of the assistant tokens (content and end-of-turn, see
data/chat.py), averaged over every assistant token of the global batch:

    loss = -(1 / N) sum_{t in M} log p(x_t | x_<t),   N = |M| over the whole global batch

Every micro-batch divides by the same global N, so the accumulated gradient is that of one big
batch, however the conversations are packed or split (token-level averaging: long replies weigh more
than short ones, as in TRL and torchtune; a per-conversation mean would need a different N).

With `model.lora` only PEFT's LoRA adapters are trained (their AdamW state only) and `final/` holds the
adapter in PEFT's format (training/lora.py). Single process; FSDP2 sharding for SFT is not implemented yet
(`training.backend` must be `torch`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import torch
from pydantic import model_validator
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.algorithms.losses import Normalisers, token_mean
from reinforge.config.loader import save_config
from reinforge.config.schema import CheckpointConfig, LoggingConfig, ModelConfig, TrainingConfig
from reinforge.config.section import Section
from reinforge.data.chat import ChatExample, fit_length, render_chat
from reinforge.data.jsonl import read_jsonl
from reinforge.data.packing import PackedBatch, micro_batches
from reinforge.errors import ConfigError, DataError
from reinforge.logging.console import ConsoleLog
from reinforge.logging.metrics import JsonlWriter, Timers
from reinforge.modeling import DTYPES, enable_activation_checkpointing, load_tokenizer, model_location
from reinforge.paths import resolve_path
from reinforge.run_dir import atomic_directory, make_run_dir
from reinforge.training import lora
from reinforge.training.segment_attention import forward_layout
from reinforge.training.torch_backend import build_optimizer, token_logprobs

# --- Config ------------------------------------------------------------------------------------


class SFTDataConfig(Section):
    train_path: str = "data/demo/sft.jsonl"
    """JSONL file of chats, one object per line with `messages`: a list of {role, content}. The loss is on
    the assistant messages; system, user and tool messages are context."""
    val_path: str | None = None
    """JSONL file of held-out chats for the validation loss; null: hold out `val_fraction` of train_path."""
    val_fraction: float = 0.0
    """With no val_path: the share of train_path's chats held out for validation (a split seeded by
    `seed`); 0 with no val_path disables validation."""
    messages_key: str = "messages"
    """Record field holding the list of messages."""
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
    max_steps: int = 100
    """Optimizer steps to run, each on `training.global_batch_size` conversations."""
    val_every: int = 50
    """Validation loss every this many steps (and before the first and after the last); 0: only then."""
    micro_batch_tokens: int = 8192
    """Positions in one forward/backward pass (rows x longest row, padding included); gradients
    accumulate over the micro-batches of a global batch. At least data.max_seq_len."""
    packing: bool = True
    """Lay several conversations end to end in each row (first-fit decreasing, attention kept within
    each conversation); false: one conversation per row, right-padded."""
    random_init: bool = False
    """Start from random weights drawn from the model's config (seeded by `seed`) instead of its trained
    weights; the tokenizer is loaded as usual. The demo config trains the demo architecture this way."""


class SFTRunConfig(Section):
    """The whole SFT run."""

    seed: int = 0
    """Seed for the validation split, data order and (with sft.random_init) the initial weights."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (all cores). 1 avoids thread contention on a
    shared machine; the results do not depend on it."""
    model: ModelConfig = ModelConfig()
    """The model to fine-tune and its tokenizer, whose chat template renders the conversations."""
    data: SFTDataConfig = SFTDataConfig()
    """Chat files, the validation split, the length cap."""
    training: TrainingConfig = TrainingConfig()
    """Optimizer and schedule (over sft.max_steps); global_batch_size counts conversations per optimizer
    step. A step's micro-batches are sized in tokens (sft.micro_batch_tokens): micro_batch_size does not apply."""
    sft: SFTConfig = SFTConfig()
    """Steps, validation, packing and micro-batching."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Whether to write the trained model to RUN_DIR/final."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/sft")
    """Run directory and console output."""

    @model_validator(mode="after")
    def _check(self) -> "SFTRunConfig":
        t, s, d = self.training, self.sft, self.data
        checks = [
            (
                t.backend == "torch",
                f"training.backend={t.backend}: sft runs in one process; set training.backend=torch (FSDP2 for sft is not implemented yet)",
            ),
            (t.num_workers == 1, "training.num_workers must be 1: sft runs in one process"),
            (
                not t.cpu_offload,
                "training.cpu_offload needs training.backend=fsdp2, which sft does not support yet; set it to false",
            ),
            (
                t.micro_batch_size == TrainingConfig.model_fields["micro_batch_size"].default,
                "training.micro_batch_size does not apply to sft, whose micro-batches are sized in tokens; set sft.micro_batch_tokens instead",
            ),
            (
                t.micro_batch_tokens is None,
                "training.micro_batch_tokens does not apply to sft; set sft.micro_batch_tokens instead",
            ),
            (
                t.sequence_packing == TrainingConfig.model_fields["sequence_packing"].default,
                "training.sequence_packing does not apply to sft; set sft.packing instead",
            ),
            (t.global_batch_size > 0, "training.global_batch_size (conversations per optimizer step) must be > 0"),
            (t.lr > 0, "training.lr must be > 0"),
            (s.max_steps >= 0, "sft.max_steps must be >= 0"),
            (self.num_threads >= 0, "num_threads must be >= 0 (0: torch's default)"),
            (s.val_every >= 0, "sft.val_every must be >= 0 (0: validate only before and after training)"),
            (d.max_seq_len > 1, "data.max_seq_len must be > 1"),
            (
                s.micro_batch_tokens >= d.max_seq_len,
                f"sft.micro_batch_tokens={s.micro_batch_tokens} < data.max_seq_len={d.max_seq_len}: a micro-batch must hold a whole row; raise it to {d.max_seq_len} or more",
            ),
            (0 <= d.val_fraction < 1, "data.val_fraction must be in [0, 1)"),
            (
                not (d.val_path and d.val_fraction > 0),
                "data.val_path and data.val_fraction are both set; validate on a file or on a held-out share: set data.val_fraction=0 or data.val_path=null",
            ),
            (self.logging.console_every >= 1, "logging.console_every must be >= 1"),
            (
                not (s.random_init and (self.model.lora or self.model.adapter)),
                "sft.random_init does not go with model.lora or model.adapter: an adapter belongs to trained base weights, which "
                "random_init replaces; set sft.random_init=false",
            ),
            (
                not (self.model.lora and self.model.lora.quantize_base != "none"),
                "model.lora.quantize_base (QLoRA) is not supported by sft, which runs in one CPU process; set it to none",
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
    s = config.sft
    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    lora.check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    tokenizer = load_tokenizer(config.model)
    train_examples, val_examples = load_datasets(config, tokenizer)
    model, peft_model = load_policy(config)
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters only
    optimizer, scheduler = build_optimizer(trainable, config.training, s.max_steps)
    # Only once the inputs are known to be good: a bad path never leaves a half-made run directory.
    run_dir = make_run_dir(config.logging.run_dir)
    save_config(
        config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": str(run_dir)})}),
        run_dir / "config.yaml",
    )
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    pad_id = tokenizer.pad_token_id
    val_batches = micro_batches(val_examples, config.data.max_seq_len, s.micro_batch_tokens, pad_id, s.packing)
    batches = global_batches(train_examples, config.training.global_batch_size, config.seed, config.data.shuffle)
    val_history: list[float] = []

    with ConsoleLog(s.max_steps, "SFT") as console:
        console.print(f"run directory: {run_dir}")
        console.print(
            f"{len(train_examples)} training / {len(val_examples)} validation conversations; "
            f"{sum(p.numel() for p in model.parameters()):,} parameters, {sum(p.numel() for p in trainable):,} trained"
        )
        if val_batches:
            metrics = validate(model, val_batches, console, step=0)
            val_history.append(metrics["val/loss"])
            metrics_log.write(0, metrics)

        for step in range(1, s.max_steps + 1):
            metrics = sft_step(model, next(batches), optimizer, scheduler, config, pad_id)
            metrics["train/epoch"] = step * config.training.global_batch_size / len(train_examples)
            if val_batches and (step == s.max_steps or (s.val_every and step % s.val_every == 0)):
                metrics.update(validate(model, val_batches, console, step))
                val_history.append(metrics["val/loss"])
            metrics_log.write(step, metrics)
            console.step(step, metrics, show_line=step % config.logging.console_every == 0)

        if config.checkpoint.save_final:
            with atomic_directory(run_dir / "final") as tmp:
                (peft_model or model).save_pretrained(tmp)  # with LoRA, the adapter in PEFT's format
                tokenizer.save_pretrained(tmp)

    first, last = (val_history[0], val_history[-1]) if val_history else (None, None)
    if first is not None:
        console.print(f"val/loss at step 0: {first:.4f}; at step {s.max_steps}: {last:.4f} ({last - first:+.4f})")
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}"
        + (f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else "")
    )
    return SFTResult(run_dir=run_dir, first_val_loss=first, last_val_loss=last)


def sft_step(
    model: PreTrainedModel,
    examples: list[ChatExample],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: SFTRunConfig,
    pad_id: int,
) -> dict[str, float]:
    """One optimizer step on one global batch of conversations. Returns its metrics."""
    timers = Timers()
    with timers.time("step"):
        batches = micro_batches(
            examples, config.data.max_seq_len, config.sft.micro_batch_tokens, pad_id, config.sft.packing
        )
        norm = Normalisers(num_tokens=sum(e.num_trained_tokens for e in examples), num_sequences=len(examples))
        optimizer.zero_grad(set_to_none=True)
        loss = torch.tensor(0.0)
        for micro in batches:
            micro_loss = nll_loss(model, micro, norm)
            micro_loss.backward()
            loss += micro_loss.detach()
        max_norm = config.training.max_grad_norm if config.training.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
    num_real_tokens = sum(b.layout.num_real_tokens for b in batches)
    return {
        "train/loss": loss.item(),
        "train/grad_norm": float(grad_norm),
        "train/lr": lr,
        "train/num_trained_tokens": norm.num_tokens,
        "train/num_micro_batches": len(batches),
        "perf/packing_efficiency": num_real_tokens / sum(b.layout.num_slots for b in batches),
        "perf/tokens_per_s": num_real_tokens / timers.seconds["step"],
        **timers.metrics(),
    }


def nll_loss(model: PreTrainedModel, micro: PackedBatch, norm: Normalisers) -> torch.Tensor:
    """This micro-batch's share of the global batch's mean NLL over assistant tokens."""
    layout = micro.layout.to(model.device)
    logprobs_RW = token_logprobs(forward_layout(model, layout).logits, layout.input_ids, temperature=1.0)
    return token_mean(-logprobs_RW, micro.loss_mask.to(model.device), norm)


def validate(model: PreTrainedModel, batches: list[PackedBatch], console: ConsoleLog, step: int) -> dict[str, float]:
    timers = Timers()
    with timers.time("val"):
        loss = validation_loss(model, batches)
    console.print(f"step {step:>4} | val/loss {loss:.4f}")
    return {"val/loss": loss, **timers.metrics()}


@torch.no_grad()
def validation_loss(model: PreTrainedModel, batches: list[PackedBatch]) -> float:
    """Mean NLL over every assistant token of the validation set (the training loss's formula)."""
    norm = Normalisers(num_tokens=sum(b.num_trained_tokens for b in batches), num_sequences=0)
    model.eval()
    loss = sum(nll_loss(model, micro, norm).item() for micro in batches)
    model.train()
    return loss


# --- Data and model ----------------------------------------------------------------------------


def load_datasets(
    config: SFTRunConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[ChatExample], list[ChatExample]]:
    """Training and validation conversations: a validation file, or a seeded held-out share, or none."""
    d = config.data
    if tokenizer.chat_template is None:
        raise ConfigError(
            f"model.name_or_path={config.model.name_or_path}: its tokenizer has no chat template, which sft needs to find the assistant tokens"
        )
    examples = load_examples(d.train_path, config, tokenizer)
    if d.val_path:
        return examples, load_examples(d.val_path, config, tokenizer)
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    num_val = round(len(examples) * d.val_fraction)
    if d.val_fraction > 0 and not 0 < num_val < len(examples):
        raise ConfigError(
            f"data.val_fraction={d.val_fraction} of {len(examples)} conversations leaves an empty split; change it"
        )
    return [examples[i] for i in sorted(order[num_val:])], [examples[i] for i in sorted(order[:num_val])]


def load_examples(path: str, config: SFTRunConfig, tokenizer: PreTrainedTokenizerBase) -> list[ChatExample]:
    """Render every chat of a JSONL file, applying data.truncation to those over data.max_seq_len."""
    d = config.data
    records = read_jsonl(resolve_path(path), required_keys=(d.messages_key,))
    examples, num_too_long = [], 0
    for number, record in enumerate(records, start=1):
        try:
            example = render_chat(record, tokenizer, d.messages_key, d.system_prompt)
        except (KeyError, TypeError, AttributeError):
            raise DataError(
                f"{path}: record {number}: `{d.messages_key}` must be a list of {{role, content}} objects"
            ) from None
        except DataError as exc:
            raise DataError(f"{path}: record {number}: {exc}") from None
        num_too_long += len(example) > d.max_seq_len
        fitted = fit_length(example, d.max_seq_len, d.truncation)
        if fitted is not None:
            examples.append(fitted)
    if not examples:
        fix = "raise it" + (" or set data.truncation=right" if d.truncation == "drop" else "")
        raise DataError(
            f"{path}: no conversation fits data.max_seq_len={d.max_seq_len} with an assistant token left; {fix}"
        )
    if num_too_long:
        action = "cut to" if d.truncation == "right" else "dropped for exceeding"
        print(
            f"{path}: {num_too_long} of {len(records)} conversations {action} data.max_seq_len={d.max_seq_len} tokens"
            f" ({len(records) - len(examples)} dropped in all)"
        )
    return examples


def load_policy(config: SFTRunConfig) -> tuple[PreTrainedModel, torch.nn.Module | None]:
    """The model to train, as (the Hugging Face model to call, its PeftModel with `model.lora` or None): its
    trained weights (with fresh LoRA adapters), or random ones from its config (sft.random_init)."""
    peft_model = None
    if config.sft.random_init:
        model_config = AutoConfig.from_pretrained(
            model_location(config.model), trust_remote_code=config.model.trust_remote_code
        )
        model = AutoModelForCausalLM.from_config(
            model_config, dtype=DTYPES[config.model.dtype], trust_remote_code=config.model.trust_remote_code
        )
    else:
        model, peft_model = lora.load_policy(config.model)
    if config.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    return model.train(), peft_model


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
