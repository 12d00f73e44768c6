"""PPO's critic with `training.backend=fsdp2`: `training.num_workers` critic ranks (the training backend with
the critic's value head, training/critic.py, and an `FSDP2Strategy` each) in Ray actors on a placement group of
their own (`cluster.num_cpus_per_worker` / `num_gpus_per_worker` each, beside the policy's ranks, never sharing
their bundles), behind the in-process critic's interface: `values`, `train_step`, `save_state`, `load_state`.
Every rank gets the whole batch, computes or trains on its share, and the values are gathered on every rank;
rank 0 answers."""

from __future__ import annotations

import torch

from reinforge.cluster.config import ClusterConfig
from reinforge.cluster.fsdp2_trainer import FSDP2Ranks
from reinforge.data.batch import TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.critic import VALUE_HEAD
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig


class FSDP2CriticGroup(FSDP2Ranks):
    def __init__(
        self,
        model: ModelConfig,
        training: TrainingConfig,
        optimizer: OptimizerConfig,
        scheduler: SchedulerConfig,
        cluster: ClusterConfig,
        num_optimizer_steps: int,
    ):
        """`optimizer`: the critic's own (its learning rate)."""
        super().__init__(
            "critic",
            training,
            cluster,
            dict(
                model_config=model.model_copy(update={"lora": None}),
                optimizer=optimizer,
                scheduler=scheduler,
                num_optimizer_steps=num_optimizer_steps,
                head=VALUE_HEAD,
            ),
        )

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.call("values", batch)[0]
