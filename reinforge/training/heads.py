"""What a training backend's model gives per trained token: the head, and how the model is loaded for it.

- `LogprobHead`: a causal LM's logprobs of the trained tokens at the sampling temperature, from the chunked LM
  head on the decoder's hidden states (training/micro_batching.py), with their entropies as a diagnostic; a loss
  may ask for the logprobs of more token ids at the same positions (`LogprobsAt`), gathered from the same chunk
  of logits.
- `ScalarHead`: a linear map from the hidden states to one number per trained token: PPO's value head
  (training/critic.py), V(s_t) from the hidden state of token t - 1 (where token t is sampled), or a reward
  model's score head, from the hidden state of the token itself (the last token of a conversation).

A head returns ([B, T] outputs on `micro.loss_mask` and 0 off it, the micro-batch with any declared fields
filled in, per-token diagnostics [B, T]); the backend hands the outputs to the loss function.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch

from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.training.base import LossFn, TrainingConfig
from reinforge.training.lora import load_policy
from reinforge.training.micro_batching import (
    HiddenStates,
    combine_context,
    micro_batch_logprobs_at,
    trained_hidden_states,
)

# load(model_config) -> (the model the backend calls, its PeftModel or None)
LoadModel = Callable[[ModelConfig], tuple[torch.nn.Module, torch.nn.Module | None]]
HeadOutputs = tuple[torch.Tensor, TrainBatch, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LogprobsAt:
    """A loss's request for the policy's logprobs [B, T, K] at the token ids [B, T, K] of batch field `ids`, put
    in batch field `into` of the micro-batch the loss sees (0 off the loss mask)."""

    ids: str
    into: str


@dataclass(frozen=True)
class Loss:
    """A loss function with the extra per-token outputs it reads: for each `LogprobsAt`, the backend puts the
    policy's logprobs at the ids of one batch field into another before calling `fn`."""

    fn: LossFn
    logprobs_at: tuple[LogprobsAt, ...] = ()

    def __call__(self, outputs_BT: torch.Tensor, micro: TrainBatch, norm: Normalisers):
        return self.fn(outputs_BT, micro, norm)

    @staticmethod
    def of(loss_fn: "LossFn | Loss") -> "Loss":
        return loss_fn if isinstance(loss_fn, Loss) else Loss(loss_fn)


def with_outputs(loss_fn: LossFn, *logprobs_at: LogprobsAt) -> Loss:
    """`loss_fn` declaring the extra per-token logprobs it reads."""
    return Loss(loss_fn, tuple(logprobs_at))


class Head(Protocol):
    def load(self, model_config: ModelConfig) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """The model to train and its PeftModel (None without LoRA), before the strategy places it."""
        ...

    def forward(
        self,
        model: torch.nn.Module,
        hidden: HiddenStates,
        micro: TrainBatch,
        rows: list[list[int]],
        config: TrainingConfig,
        logprobs_at: tuple[LogprobsAt, ...],
    ) -> HeadOutputs:
        """The micro-batch's outputs [B, T], the micro-batch with `logprobs_at`'s fields, per-token diagnostics."""
        ...


@dataclass(frozen=True)
class LogprobHead:
    """A causal LM's per-token logprobs under softmax(logits / temperature); the policy with `model.lora`'s
    adapters when set."""

    temperature: float
    load_model: LoadModel = load_policy

    def load(self, model_config: ModelConfig):
        return self.load_model(model_config)

    def forward(self, model, hidden, micro, rows, config, logprobs_at=()) -> HeadOutputs:
        ids_BTK = torch.cat([getattr(micro, at.ids) for at in logprobs_at], dim=-1) if logprobs_at else None
        logprobs_BT, entropy_BT, at_ids_BTK = micro_batch_logprobs_at(
            model, hidden, micro, rows, config, self.temperature, ids_BTK
        )
        if logprobs_at:
            sizes = [getattr(micro, at.ids).shape[-1] for at in logprobs_at]
            parts = at_ids_BTK.split(sizes, dim=-1)
            micro = replace(micro, **{at.into: part for at, part in zip(logprobs_at, parts)})
        return logprobs_BT, micro, {"entropy": entropy_BT}


@dataclass(frozen=True)
class ScalarHead:
    """`model.<module>` (hidden size -> 1) applied to the hidden state that predicts each trained token
    (`from_previous_token`: a value V(s_t) of the state token t is sampled in) or of the token itself (a reward
    model's score of the conversation up to and including it)."""

    module: str
    from_previous_token: bool
    load_model: LoadModel
    causal_lm: bool = True
    """The model is a causal LM (its LM head runs on one position per row only); false: a model without one."""

    def load(self, model_config: ModelConfig):
        return self.load_model(model_config)

    def forward(self, model, hidden, micro, rows, config, logprobs_at=()) -> HeadOutputs:
        assert not logprobs_at, "a scalar head gives no logprobs"
        hidden_NH, _, (b_index, t_index) = trained_hidden_states(
            model,
            hidden,
            micro,
            rows,
            config,
            shift=1 if self.from_previous_token else 0,
            logits_to_keep=1 if self.causal_lm else None,
        )
        values_N = getattr(model, self.module)(hidden_NH).squeeze(-1).float()
        values_BT = values_N.new_zeros(micro.loss_mask.shape).index_put((b_index, t_index), values_N)
        return combine_context(model, values_BT), micro, {}
