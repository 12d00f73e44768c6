"""One rank of PPO's critic on the FSDP2 training backend (`training.backend=fsdp2`).

An `FSDP2Worker` made a critic by `ValueHead` (training/critic.py): the value head is added to the base
model before sharding, so FSDP2 shards it with the root module (beside the embeddings) and the root's
forward leaves it whole for the head to be applied after the decoder, as the LM head is for logprobs.
Everything else is the policy rank's: each rank computes the values of its share of the batch and the
shares are gathered on every rank; the value loss divides by the whole batch's normalisers and the
gradients are SUM-reduced, so N ranks give one rank's (and the torch critic's) gradient; checkpoints are
the same sharded torch.distributed.checkpoint directories, `value_head.weight` among the model's keys.
"""

from __future__ import annotations

from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.training.critic import ValueHead
from reinforge.training.fsdp2_worker import FSDP2Worker


class FSDP2Critic(ValueHead, FSDP2Worker):
    """One critic rank: `values(batch)` (the whole batch's, on every rank) and `train_step(batch, value_loss_fn)`."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_config: ModelConfig,
        training_config: TrainingConfig,
        num_optimizer_steps: int,
    ):
        super().__init__(
            rank,
            world_size,
            master_addr,
            master_port,
            model_config.model_copy(update={"lora": None}),
            training_config,
            temperature=1.0,
            num_optimizer_steps=num_optimizer_steps,
            load_reference=False,
        )
