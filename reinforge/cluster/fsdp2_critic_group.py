"""PPO's critic with `training.backend=fsdp2`: `training.num_workers` critic ranks (training/fsdp2_critic.py)
in Ray actors on a placement group of their own (`cluster.num_cpus_per_worker` / `num_gpus_per_worker` each,
beside the policy's ranks, never sharing their bundles), behind the torch critic's interface: `values`,
`train_step`, `save_state`, `load_state`. Every rank gets the whole batch, computes or trains on its share,
and the values are gathered on every rank; rank 0 answers."""

from __future__ import annotations

import torch

from reinforge.cluster.fsdp2_trainer import FSDP2Ranks
from reinforge.config.schema import Config, TrainingConfig
from reinforge.data.batch import TrainBatch
from reinforge.training.fsdp2_critic import FSDP2Critic


class FSDP2CriticGroup(FSDP2Ranks):
    def __init__(self, config: Config, training_config: TrainingConfig, num_optimizer_steps: int):
        """`training_config`: `training.*` with the critic's learning rate."""
        super().__init__(
            "critic",
            FSDP2Critic,
            config,
            dict(model_config=config.model, training_config=training_config, num_optimizer_steps=num_optimizer_steps),
        )

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.call("values", batch)[0]
