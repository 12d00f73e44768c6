"""PPO's critic on the single-process torch backend: a value head on its own copy of the base model.

The critic is the policy's base model (`model.name_or_path`, with `model.adapter` merged when set) with
one more module, `value_head`, a linear map from the decoder's last hidden state to a scalar, initialised
to zero (so every value starts at 0 and the first steps fit the head before they move the trunk). The
model's LM head is never read. Its value of token t, V(s_t), comes from the hidden state of token t - 1:
the state in which token t is sampled, the position the policy's logprob of token t comes from.

It is a `TorchBackend` whose micro-batches compute values instead of logprobs: the same micro-batch
planning, packing and shared prompts (training/micro_batching.py), so packed = padded and micro-batches
sum to the one-batch gradient; the same AdamW, schedule, clipping and `save_state`/`load_state` (the
head is part of the model's state dict). Its optimizer takes `training.*` with the critic's own
learning rate.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from reinforge.algorithms.losses import Normalisers
from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.data.batch import TrainBatch
from reinforge.training.micro_batching import Prompts, trained_hidden_states
from reinforge.training.segment_attention import using_segment_attention
from reinforge.training.torch_backend import TorchBackend, accumulate_metrics, build_optimizer

# value_loss_fn(values_BT, micro_batch, normalisers) -> (loss, summable metric contributions); values_BT is
# [B, T] like micro_batch.loss_mask, 0 off it
ValueLossFn = Callable[[torch.Tensor, TrainBatch, Normalisers], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class CriticBackend(TorchBackend):
    """The critic: `values(batch)` and `train_step(batch, value_loss_fn)`, saved and restored like a policy."""

    def __init__(self, model_config: ModelConfig, training_config: TrainingConfig, num_optimizer_steps: int):
        super().__init__(model_config.model_copy(update={"lora": None}), training_config, temperature=1.0,
                         num_optimizer_steps=num_optimizer_steps, load_reference=False)
        text_config = self.model.config.get_text_config()
        dtype = next(self.model.parameters()).dtype
        self.model.value_head = torch.nn.Linear(text_config.hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.model.value_head.weight)
        torch.nn.init.zeros_(self.model.value_head.bias)
        self.model.value_head.to(next(self.model.parameters()).device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.trainable, training_config, num_optimizer_steps)

    def _micro_values(self, micro: TrainBatch, rows: list[list[int]]) -> torch.Tensor:
        hidden_NH, _, (b_index, t_index) = trained_hidden_states(self.model, self.hidden[id(self.model)], micro, rows, self.config)
        values_N = self.model.value_head(hidden_NH).squeeze(-1).float()
        return values_N.new_zeros(micro.loss_mask.shape).index_put((b_index, t_index), values_N)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """V(s_t) [B, T] on `batch.loss_mask`, 0 off it, without gradients."""
        out = torch.zeros_like(batch.loss_mask)
        for indices, micro, rows in self._micro_batches(batch):
            values_BT = self._micro_values(micro, rows)
            out[indices, : values_BT.shape[1]] = values_BT
        return out * batch.loss_mask

    def accumulate_gradients(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """Add the gradient of the global-batch value loss to `.grad`, one micro-batch at a time
        (`TorchBackend.train_step` then clips and steps)."""
        norm = batch.normalisers()
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.tensor(0.0))
        extremes: dict[str, torch.Tensor] = {}
        for _, micro, rows in self._micro_batches(batch):
            with using_segment_attention(self.model, Prompts.shared(micro, self.config)):
                loss, metrics = loss_fn(self._micro_values(micro, rows), micro, norm)
                loss.backward()
            accumulate_metrics(totals, extremes, metrics)
        return {name: float(value) for name, value in (totals | extremes).items()}
