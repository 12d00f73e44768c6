"""What the two preference-pair recipes (`dpo.py`, `rm.py`) share: the run config's common sections and
checks, pairs as a training batch, one optimizer step over a global batch of pairs and the held-out pass, both
through the training backend (training/backend.py), in this process or on FSDP2 ranks
(loops/builders.py, `build_recipe_backend`).

Batch sizes count sequences, as everywhere in `training`: a pair is two sequences (chosen and
rejected, always in the same micro-batch), so `training.global_batch_size / 2` pairs make one
optimizer step and `training.micro_batch_size / 2` pairs one forward/backward pass. The two are consecutive
rows, so on FSDP2 ranks (each training on its contiguous share of a batch's rows) a share of an even number of
rows holds whole pairs: `global_batch_size` must be a multiple of 2 x `num_workers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import model_validator

from reinforge.cluster.config import ClusterConfig
from reinforge.config.section import Section
from reinforge.data.batch import TrainBatch
from reinforge.data.preference import PreferenceDataConfig, TokenizedPair, collate_pairs
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import BackendConfig, LossFn, TrainingConfig
from reinforge.training.checkpoint import CheckpointConfig
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig


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


class PairRunConfig(Section):
    """The sections every pair recipe has; each recipe adds its own."""

    seed: int = 0
    """Seed for the data order and any freshly initialised weights."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (all cores)."""
    model: ModelConfig = ModelConfig()
    """The model to start from (a causal LM in Hugging Face format)."""
    data: PreferenceDataConfig = PreferenceDataConfig()
    """The preference pairs."""
    training: PairTrainingConfig = PairTrainingConfig()
    """The training backend (in this process, or `backend: fsdp2` on `num_workers` ranks) and the batch sizes, in
    sequences (two per pair)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The learning-rate schedule over the recipe's max_steps."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Whether to write the trained model to RUN_DIR/final."""
    cluster: ClusterConfig = ClusterConfig()
    """With `training.backend=fsdp2`: the Ray cluster the ranks run on and each rank's resources."""

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
        if self.model.lora and self.model.lora.quantize_base != "none":
            raise ValueError("model.lora.quantize_base (QLoRA) is not supported by preference training; set it to none")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0 (0: torch's default)")
        if self.data.max_length < 2:
            raise ValueError("data.max_length must be at least 2 tokens")
        return self


def check_schedule(max_steps: int, val_every: int, section: str) -> None:
    """The recipe's step counts, checked at load time."""
    if max_steps < 0:
        raise ValueError(f"{section}.max_steps must be >= 0")
    if val_every < 0:
        raise ValueError(f"{section}.val_every must be >= 0 (0: validate only before and after training)")


@dataclass
class PairRunResult:
    run_dir: Path
    first_val: dict[str, float]  # val/ metrics before training (empty without validation)
    last_val: dict[str, float]  # val/ metrics after the last step


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
    collated = collate_pairs(pairs, pad_token_id)
    num = len(pairs)
    # collate_pairs' rows: chosen [0, N), rejected [N, 2N)
    order = torch.stack([torch.arange(num), torch.arange(num) + num], dim=1).flatten()
    input_ids, attention_mask = collated.input_ids[order], collated.attention_mask[order]
    loss_mask = collated.loss_mask[order]
    if last_token_only:
        last_B = attention_mask.sum(dim=1) - 1
        loss_mask = torch.zeros_like(loss_mask).index_put_((torch.arange(2 * num), last_B), torch.tensor(1.0))
    zeros = torch.zeros_like(loss_mask)
    images = [pair.images for pair in pairs for _ in range(2)]  # a vision-language model's pairs: both rows'
    return batch_type(
        input_ids,
        attention_mask,
        loss_mask,
        advantages=zeros,
        gen_logprobs=zeros,
        images=images if any(i is not None for i in images) else None,
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


def optimizer_step(backend: Backend, batch: PairTrainBatch, loss_fn: LossFn) -> dict[str, float]:
    """One AdamW step on a global batch of pairs through the training backend: the gradient accumulates micro-batch
    by micro-batch (the loss is normalised by the global number of pairs, so this equals one big batch), clip, step."""
    return backend.train_step(batch, loss_fn)


def evaluate(backend: Backend, batch: PairTrainBatch, loss_fn: LossFn) -> dict[str, float]:
    """The loss and metrics of all the pairs of `batch` as one batch, in eval mode without gradients, prefixed
    `val/`."""
    return with_prefix("val", backend.evaluate(batch, loss_fn))


def with_prefix(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{name}": value for name, value in metrics.items()}
