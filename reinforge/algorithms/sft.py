"""Supervised fine-tuning on chats: the recipe the supervised loop (loops/supervised.py) runs.

Each step the loop draws the next `training.global_batch_size` conversations (a seeded shuffle per epoch); here they
become rows, the loss on their assistant tokens; the backend packs them into rows of at most `data.max_seq_len`
tokens and the rows into micro-batches of at most `training.micro_batch_tokens` positions, and takes one AdamW step.

The loss is the negative log-likelihood of the assistant tokens (content and end-of-turn, see
data/chat.py), averaged over every assistant token of the global batch:

    loss = -(1 / N) sum_{t in M} log p(x_t | x_<t),   N = |M| over the whole global batch

Every micro-batch divides by the same global N, so the accumulated gradient is that of one big
batch, however the conversations are packed or split (token-level averaging: long replies weigh more
than short ones, as in TRL and torchtune; a per-conversation mean would need a different N).

With `model.lora` only PEFT's LoRA adapters are trained (their AdamW state only) and `final/` holds the
adapter in PEFT's format (training/lora.py). With `training.backend=fsdp2` each of `training.num_workers` ranks
trains on its share of the global batch's conversations: the same gradient, so the same run.
"""

from __future__ import annotations

import random

import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.algorithms.losses import token_mean
from reinforge.algorithms.sft_config import SFTRunConfig
from reinforge.algorithms.supervised_recipe import RecipeModel, SupervisedRecipe
from reinforge.data.batch import Normalisers, TrainBatch, sequences_batch
from reinforge.data.chat import ChatExample, fit_length, render_chat
from reinforge.data.sources import Source
from reinforge.errors import ConfigError, DataError
from reinforge.logging.metrics import Timers
from reinforge.model_config import ModelConfig
from reinforge.modeling import DTYPES, check_fits_context, check_weights, load_processor, model_class, model_location
from reinforge.training import lora
from reinforge.training.base import LossFn
from reinforge.training.heads import LogprobHead

# --- The recipe --------------------------------------------------------------------------------


class SFT(SupervisedRecipe):
    """The conversations of data.train_path, drawn `training.global_batch_size` a step; the policy's LM head at
    temperature 1 (from random weights with `sft.random_init`), conversations packed (`training.sequence_packing`)
    into rows of `data.max_seq_len` tokens; the loss, the NLL of the assistant tokens."""

    title = "SFT"

    def __init__(self, config: SFTRunConfig, tokenizer: PreTrainedTokenizerBase):
        if not config.sft.random_init:
            check_weights(config.model)
        check_fits_context(config.model, config.data.max_seq_len, f"data.max_seq_len={config.data.max_seq_len}")
        train, self.val = load_datasets(config, tokenizer)
        head = LogprobHead(temperature=1.0, load_model=random_model if config.sft.random_init else lora.load_policy)
        model = RecipeModel(head, row_tokens=config.data.max_seq_len)
        super().__init__(train, len(self.val), config.training.global_batch_size, model)
        self.pad_id = tokenizer.pad_token_id

    def train_batch(self, indices: list[int], timers: Timers) -> tuple[TrainBatch, LossFn]:
        return examples_batch([self.examples[i] for i in indices], self.pad_id), nll_loss

    def val_batch(self) -> tuple[TrainBatch, LossFn]:
        return examples_batch(self.val, self.pad_id), nll_loss


def nll_loss(logprobs_BT: torch.Tensor, micro: TrainBatch, norm: Normalisers):
    """This micro-batch's share of the global batch's mean NLL over assistant tokens."""
    loss = token_mean(-logprobs_BT, micro.loss_mask, norm)
    return loss, {"loss": loss.detach()}


def examples_batch(examples: list[ChatExample], pad_id: int) -> TrainBatch:
    """Conversations as right-padded rows, the loss on their assistant tokens (no advantages: SFT's loss has none)."""
    return sequences_batch([(e.token_ids, e.loss_mask) for e in examples], pad_id, [e.images for e in examples])


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
