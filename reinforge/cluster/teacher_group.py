"""A distillation teacher (training/teacher.py) in a Ray actor of its own (`distill.teachers[].placement=ray`),
behind the in-process teacher's `score`: a worker group of one, with `cluster.num_cpus_per_worker` CPUs and
`cluster.num_gpus_per_worker` GPUs. The batch goes through the object store; the scores come back."""

from __future__ import annotations

import torch

from reinforge.cluster.config import ClusterConfig
from reinforge.cluster.worker_group import WorkerGroup
from reinforge.data.batch import TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.teacher import Teacher


class TeacherGroup:
    def __init__(
        self, model_config: ModelConfig, training_config: TrainingConfig, temperature: float, cluster: ClusterConfig
    ):
        self.group = WorkerGroup(
            f"teacher {model_config.name_or_path}",
            Teacher,
            1,
            lambda rank, ip: dict(model_config=model_config, training_config=training_config, temperature=temperature),
            num_cpus_per_worker=cluster.num_cpus_per_worker,
            num_gpus_per_worker=cluster.num_gpus_per_worker,
            timeout_s=cluster.worker_timeout_s,
            heartbeat_timeout_s=cluster.heartbeat_timeout_s,
        )

    def score(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.group.call("score", batch, k)[0]

    def shutdown(self) -> None:
        self.group.shutdown()
