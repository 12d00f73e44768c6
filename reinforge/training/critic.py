"""PPO's critic: a value head on its own copy of the base model, on either training backend.

The critic is the policy's base model (`model.name_or_path`, with `model.adapter` merged when set) with
one more module, `value_head`, a linear map from the decoder's last hidden state to a scalar, initialised
to zero (so every value starts at 0 and the first steps fit the head before they move the trunk). The
model's LM head is never read. Its value of token t, V(s_t), comes from the hidden state of token t - 1:
the state in which token t is sampled, the position the policy's logprob of token t comes from.

`ValueHead` turns a training backend into a critic whose micro-batches compute values instead of
logprobs: `CriticBackend` here (a `TorchBackend`), `FSDP2Critic` (one FSDP2 rank, training/fsdp2_critic.py).
Each keeps its backend's micro-batch planning, packing and shared prompts (training/micro_batching.py),
so packed = padded and micro-batches sum to the one-batch gradient, and its AdamW, schedule, clipping and
`save_state`/`load_state` (the head is part of the model's state dict). Its optimizer takes `training.*`
with the critic's own learning rate.
"""

from __future__ import annotations

from typing import Callable

import torch

from reinforge.algorithms.losses import Normalisers
from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.data.batch import TrainBatch
from reinforge.training.micro_batching import trained_hidden_states
from reinforge.training.torch_backend import TorchBackend

# value_loss_fn(values_BT, micro_batch, normalisers) -> (loss, summable metric contributions); values_BT is
# [B, T] like micro_batch.loss_mask, 0 off it
ValueLossFn = Callable[[torch.Tensor, TrainBatch, Normalisers], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def add_value_head(model: torch.nn.Module) -> None:
    """`model.value_head`: hidden state -> scalar, zero-initialised, in the model's dtype and on its device."""
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    model.value_head = torch.nn.Linear(model.config.get_text_config().hidden_size, 1, dtype=dtype)
    torch.nn.init.zeros_(model.value_head.weight)
    torch.nn.init.zeros_(model.value_head.bias)
    model.value_head.to(device)


class ValueHead:
    """What makes a training backend (`TorchBackend`, or one FSDP2 rank, training/fsdp2_critic.py) a critic: its
    model gets the value head before anything else sees it, its per-token pass gives values instead of
    logprobs, and its micro-batches back-propagate a value loss. Put before the backend among the bases."""

    def _load_trained_model(self, model_config: ModelConfig):
        model, peft = super()._load_trained_model(model_config)
        add_value_head(model)
        return model, peft

    def _micro_values(self, micro: TrainBatch, rows: list[list[int]]) -> torch.Tensor:
        hidden_NH, _, (b_index, t_index) = trained_hidden_states(
            self.model, self.hidden[id(self.model)], micro, rows, self.config
        )
        values_N = self.model.value_head(hidden_NH).squeeze(-1).float()
        return values_N.new_zeros(micro.loss_mask.shape).index_put((b_index, t_index), values_N)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """V(s_t) [B, T] on `batch.loss_mask`, 0 off it, without gradients."""
        return self._per_token(batch, self._micro_values)

    def _backward(
        self, micro: TrainBatch, rows: list[list[int]], loss_fn: ValueLossFn, norm: Normalisers
    ) -> dict[str, torch.Tensor]:
        """The value loss's forward and backward on one micro-batch (the backend's `train_step` accumulates,
        clips and steps)."""
        loss, metrics = loss_fn(self._micro_values(micro, rows), micro, norm)
        loss.backward()
        return metrics


class CriticBackend(ValueHead, TorchBackend):
    """The critic in this process: `values(batch)` and `train_step(batch, value_loss_fn)`, saved and restored like a policy."""

    def __init__(self, model_config: ModelConfig, training_config: TrainingConfig, num_optimizer_steps: int):
        super().__init__(
            model_config.model_copy(update={"lora": None}),
            training_config,
            temperature=1.0,
            num_optimizer_steps=num_optimizer_steps,
            load_reference=False,
        )
