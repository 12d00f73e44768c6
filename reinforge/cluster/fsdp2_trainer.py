"""`training.backend=fsdp2`: N FSDP2 ranks (`training/fsdp2_worker.py`) in Ray actors, behind the
same training-backend interface as the single-process `TorchBackend`, so the GRPO loop does not know
where its ranks run. Every rank gets the whole global batch (through the object store, once) and
trains on its share; rank 0 answers. `FSDP2Ranks` is what every model trained on FSDP2 shares (the
policy's `FSDP2Trainer` here, PPO's critic in cluster/fsdp2_critic_group.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from reinforge.cluster.network import free_port
from reinforge.cluster.worker_group import WorkerGroup
from reinforge.config.schema import Config
from reinforge.data.batch import TrainBatch
from reinforge.training.base import LossFn
from reinforge.training.fsdp2_worker import FSDP2Worker


class FSDP2Ranks:
    """`training.num_workers` ranks of an FSDP2 worker class (its `__init__` takes rank, world_size, master_addr,
    master_port and `worker_kwargs`) on a placement group of their own: train steps, checkpoints, memory."""

    def __init__(
        self, name: str, worker_cls: type, config: Config, worker_kwargs: dict[str, Any], actor_fraction: float = 1.0
    ):
        port = free_port()
        num_workers = config.training.num_workers
        self.group = WorkerGroup(
            name,
            worker_cls,
            num_workers,
            lambda rank, master_ip: dict(
                rank=rank, world_size=num_workers, master_addr=master_ip, master_port=port, **worker_kwargs
            ),
            num_cpus_per_worker=config.cluster.num_cpus_per_worker,
            num_gpus_per_worker=config.cluster.num_gpus_per_worker,
            timeout_s=config.cluster.worker_timeout_s,
            actor_fraction=actor_fraction,
        )

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        return self.group.call("train_step", batch, loss_fn)[0]

    def memory_metrics(self) -> dict[str, float]:
        """`perf/<group>[r]/peak_rss_gb` (and `gpu_peak_memory_gb`) of every rank."""
        return {
            f"perf/{self.group.name}[{rank}]/{name}": value
            for rank, metrics in enumerate(self.group.call("memory"))
            for name, value in metrics.items()
        }

    def save_state(self, path: Path) -> None:
        self.group.call("save_state", str(path))

    def load_state(self, path: Path) -> None:
        self.group.call("load_state", str(path))

    def shutdown(self) -> None:
        self.group.shutdown()


class FSDP2Trainer(FSDP2Ranks):
    """The policy (and its frozen reference) on FSDP2 ranks."""

    def __init__(self, config: Config, num_optimizer_steps: int):
        super().__init__(
            "training",
            FSDP2Worker,
            config,
            dict(
                model_config=config.model,
                training_config=config.training,
                temperature=config.generation.temperature,
                num_optimizer_steps=num_optimizer_steps,
                load_reference=config.loss.kl_coef > 0,
            ),
            actor_fraction=0.5 if config.cluster.colocate else 1.0,
        )  # colocated engines take the other half

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        return self.group.call("logprobs", batch, reference)[0]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.group.call("full_state")[0])

    def save_pretrained(self, path: Path) -> None:
        self.group.call("save_pretrained", str(path))

    def save_adapter(self, path: Path) -> None:
        self.group.call("save_adapter", str(path))
