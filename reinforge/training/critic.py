"""PPO's critic: the training backend around a model with a value head.

The critic is the policy's base model (`model.name_or_path`, with `model.adapter` merged when set, never
`model.lora`) with one more module, `value_head`, a linear map from the decoder's last hidden state to a
scalar, initialised to zero (so every value starts at 0 and the first steps fit the head before they move the
trunk). The model's LM head is never read. Its value of token t, V(s_t), comes from the hidden state of token
t - 1: the state in which token t is sampled, the position the policy's logprob of token t comes from.

`critic_backend` builds it as a `Backend` (training/backend.py) with a `ScalarHead`, so it keeps the backend's
micro-batch planning, packing and shared prompts (training/micro_batching.py), so packed = padded and
micro-batches sum to the one-batch gradient, its strategy (this process, or an FSDP2 rank: the head is
sharded with the root module), AdamW, schedule, clipping and `save_state`/`load_state` (the head is part of
the model's state dict). Its optimizer is the critic's own (PPO's `ppo.critic_lr`).
"""

from __future__ import annotations

from typing import Callable

import torch

from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import ScalarHead
from reinforge.training.lora import load_policy
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.strategy import Strategy

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


def load_critic(model_config: ModelConfig) -> tuple[torch.nn.Module, None]:
    """The base model (no LoRA) with its value head."""
    model, _ = load_policy(model_config.model_copy(update={"lora": None}))
    add_value_head(model)
    return model, None


VALUE_HEAD = ScalarHead("value_head", from_previous_token=True, load_model=load_critic)


def critic_backend(
    model_config: ModelConfig,
    training: TrainingConfig,
    optimizer: OptimizerConfig,
    scheduler: SchedulerConfig,
    num_optimizer_steps: int,
    strategy: Strategy | None = None,
) -> Backend:
    """The critic: `values(batch)` and `train_step(batch, value_loss_fn)`, saved and restored like a policy."""
    return Backend(
        model_config.model_copy(update={"lora": None}),
        training,
        optimizer,
        scheduler,
        num_optimizer_steps,
        head=VALUE_HEAD,
        strategy=strategy,
    )
