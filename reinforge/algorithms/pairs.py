"""What the two preference-pair recipes (`dpo.py`, `rm.py`) share: the run config's common sections and
checks, the pairs they load, and pairs as a training batch.

Batch sizes count sequences, as everywhere in `training`: a pair is two sequences (chosen and
rejected, always in the same micro-batch), so `training.global_batch_size / 2` pairs make one
optimizer step and `training.micro_batch_size / 2` pairs one forward/backward pass. The two are consecutive
rows, so on FSDP2 ranks (each training on its contiguous share of a batch's rows) a share of an even number of
rows holds whole pairs: `global_batch_size` must be a multiple of 2 x `num_workers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import model_validator
from transformers import PreTrainedTokenizerBase

from reinforge.algorithms.supervised_recipe import RecipeModel, SupervisedRecipe, SupervisedRunConfig
from reinforge.data.batch import TrainBatch, sequences_batch
from reinforge.data.preference import PreferenceDataConfig, Tokenize, TokenizedPair, load_pairs
from reinforge.modeling import check_fits_context, check_weights
from reinforge.training.base import BackendConfig, TrainingConfig


class PairTrainingConfig(BackendConfig):
    """`training:` of the pair recipes (DPO, RM): the backend's settings, batch sizes in sequences (two per pair:
    chosen and rejected, always in the same micro-batch)."""

    global_batch_size: int = 128
    """Sequences per optimizer step (twice the pairs); even."""
    micro_batch_size: int = 32
    """Sequences per forward/backward pass (twice the pairs); even, and a divisor of `global_batch_size`."""
    sequence_packing: bool = True
    """Lay a micro-batch's sequences end to end in rows as wide as its longest (each attending to itself only)
    instead of one right-padded sequence per row: the same logprobs, no compute on padding."""

    def backend_config(self) -> TrainingConfig:
        """What the backend reads: these settings, micro-batches by sequences (a token budget could split a
        pair), no prompt to share."""
        return TrainingConfig(**self.model_dump(), share_prompts=False)


class PairRunConfig(SupervisedRunConfig):
    """The sections every pair recipe has; each recipe adds its own and its `logging`."""

    data: PreferenceDataConfig = PreferenceDataConfig()
    """The preference pairs."""
    training: PairTrainingConfig = PairTrainingConfig()
    """The training backend (in this process, or `backend: fsdp2` on `num_workers` ranks) and the batch sizes, in
    sequences (two per pair)."""

    @model_validator(mode="after")
    def _check_training(self) -> "PairRunConfig":
        training = self.training
        if training.global_batch_size % (2 * training.num_workers):
            raise ValueError(
                f"training.global_batch_size={training.global_batch_size} does not split into whole pairs over "
                f"training.num_workers={training.num_workers} ranks: set it to a multiple of "
                f"{2 * training.num_workers} (two sequences per pair per rank)"
            )
        if (
            training.global_batch_size < 2
            or training.global_batch_size % 2
            or training.micro_batch_size < 2
            or training.micro_batch_size % 2
        ):
            raise ValueError(
                f"training.global_batch_size={training.global_batch_size} and training.micro_batch_size="
                f"{training.micro_batch_size} count sequences, two per pair (chosen and rejected): set both to even "
                "numbers, at least 2"
            )
        if training.global_batch_size % training.micro_batch_size:
            raise ValueError(
                f"training.micro_batch_size={training.micro_batch_size} does not divide training.global_batch_size="
                f"{training.global_batch_size}; set it to an even divisor of {training.global_batch_size}"
            )
        if self.data.max_length < 2:
            raise ValueError("data.max_length must be at least 2 tokens")
        return self


class PairRecipe(SupervisedRecipe):
    """The pairs of data.train_path, drawn `training.global_batch_size / 2` a step, and the first
    `data.max_val_pairs` of data.val_path held out; each recipe tokenizes them its way and adds its loss."""

    def __init__(
        self,
        config: PairRunConfig,
        tokenizer: PreTrainedTokenizerBase,
        tokenize: Tokenize,
        model: RecipeModel,
        processor=None,
    ):
        check_weights(config.model)
        check_fits_context(config.model, config.data.max_length, f"data.max_length={config.data.max_length}")
        data, self.pad_id = config.data, tokenizer.pad_token_id
        train = load_pairs(data.train_path, tokenizer, tokenize, data, processor)
        self.val = (
            load_pairs(data.val_path, tokenizer, tokenize, data, processor, val=True)[: data.max_val_pairs]
            if data.val_path
            else []
        )
        model.rows_together = 2  # a pair's chosen and rejected rows
        super().__init__(train, len(self.val), config.training.global_batch_size // 2, model)


@dataclass
class PairTrainBatch(TrainBatch):
    """Pairs as a training batch: each pair's chosen then rejected sequence in consecutive rows (so that micro-batches
    of an even `training.micro_batch_size` hold whole pairs), which the packing may reorder inside a micro-batch."""

    pair_index: torch.Tensor | None = None  # [B] long: the pair of each sequence
    chosen: torch.Tensor | None = None  # [B] bool: whether it is the pair's chosen sequence


def pair_batch(
    pairs: list[TokenizedPair],
    pad_token_id: int,
    last_token_only: bool = False,
    batch_type: type[PairTrainBatch] = PairTrainBatch,
    **fields,
) -> PairTrainBatch:
    """The pairs' 2N sequences interleaved (chosen 0, rejected 0, chosen 1, ...), the loss mask on the reply tokens
    or, with `last_token_only`, on each sequence's last token (a reward model's score); `fields`: more batch
    fields, [2N] in the interleaved order."""

    def weights(ids: list[int], num_prompt: int) -> list[float]:
        if last_token_only:
            return [0.0] * (len(ids) - 1) + [1.0]
        return [0.0] * num_prompt + [1.0] * (len(ids) - num_prompt)

    sequences = [(ids, weights(ids, p.num_prompt_tokens)) for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    num = len(pairs)
    return sequences_batch(
        sequences,
        pad_token_id,
        [pair.images for pair in pairs for _ in range(2)],  # a vision-language model's pairs: both rows'
        batch_type,
        pair_index=torch.arange(num).repeat_interleave(2),
        chosen=torch.tensor([True, False]).repeat(num),
        **fields,
    )


def chosen_and_rejected(
    values_B: torch.Tensor, micro: PairTrainBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P], pair indices [P]) of the micro-batch's P whole pairs, in pair order."""
    order = (micro.pair_index * 2 + (~micro.chosen).long()).argsort()
    pairs_P2 = micro.pair_index[order].view(-1, 2)
    assert bool((pairs_P2[:, 0] == pairs_P2[:, 1]).all()), (
        "a pair was split over micro-batches: pair recipes need micro-batches of an even training.micro_batch_size"
    )
    values_P2 = values_B[order].view(-1, 2)
    return values_P2[:, 0], values_P2[:, 1], order.view(-1, 2)[:, 0]
