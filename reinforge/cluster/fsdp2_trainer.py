"""`training.backend=fsdp2`: N ranks of the training backend (training/backend.py, each with an `FSDP2Strategy`,
training/fsdp2.py) in Ray actors, behind the same training-backend interface as the backend in one process, so
the RL loop does not know where its ranks run. Every rank gets the whole global batch (through the object store,
once) and trains on its share; rank 0 answers. `FSDP2Ranks` is what every model trained on FSDP2 shares (the
RL loop's policy and PPO's critic, each an `FSDP2Trainer` here, the SFT, DPO and RM models in
cluster/fsdp2_group.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from reinforge.cluster.config import ClusterConfig, TrainerClusterConfig
from reinforge.cluster.worker_group import WorkerGroup
from reinforge.data.batch import TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.network import free_port
from reinforge.training.backend import Backend
from reinforge.training.base import LossFn, TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import Head
from reinforge.training.numerics import fault_step, warn
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig


class FSDP2Ranks:
    """`training.num_workers` backends, one FSDP2 rank each, on a placement group of their own: train steps,
    checkpoints, memory. `backend_kwargs` go to every rank's `Backend` beside its strategy."""

    def __init__(
        self,
        name: str,
        training: TrainingConfig,
        cluster: TrainerClusterConfig,
        backend_kwargs: dict[str, Any],
        actor_fraction: float = 1.0,
    ):
        port, num_workers = free_port(), training.num_workers
        # the ranks with distinct shares of a batch (tensor- and context-parallel ranks of one share compute together)
        self.shares = training.parallel.resolved(num_workers).data_parallel
        # the testing hook of the driver's environment, which the ranks of a Ray cluster started elsewhere lack
        backend_kwargs = {**backend_kwargs, "nonfinite_fault_at": fault_step()}
        self.group = WorkerGroup(
            name,
            Backend,
            num_workers,
            lambda rank, master_ip: dict(
                strategy=FSDP2Strategy(rank, num_workers, master_ip, port), training=training, **backend_kwargs
            ),
            num_cpus_per_worker=cluster.num_cpus_per_worker,
            num_gpus_per_worker=cluster.num_gpus_per_worker,
            timeout_s=cluster.worker_timeout_s,
            heartbeat_timeout_s=cluster.heartbeat_timeout_s,
            actor_fraction=actor_fraction,
            resources=cluster.training_resources,
        )

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, step: int | None = None) -> dict[str, float]:
        """Rank 0's metrics; the line of a skipped non-finite step shown here (the ranks' output is no console)."""
        metrics, note = self.group.call("checked_step", batch, loss_fn, step)[0]
        if note:
            warn(note)
        return metrics

    def loss_pass(self, batch: TrainBatch, loss_fn, backward: bool) -> tuple[dict[str, float], list]:
        """`Backend.loss_pass` on every rank (the batch splits evenly over `shares`): rank 0's metrics, and the loss
        function as every rank left it (each has its share's outputs)."""
        return self.group.call("loss_pass", batch, loss_fn, backward)[0]

    def adam_step(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, max_grad_norm: float
    ) -> tuple[dict[str, float], str | None]:
        return self.group.call("adam_step", lr, betas, eps, weight_decay, max_grad_norm)[0]

    def memory_metrics(self) -> dict[str, float]:
        """`perf/<group>[r]/peak_rss_gb` (and `gpu_peak_memory_gb`) of every rank."""
        return {
            f"perf/{self.group.name}[{rank}]/{name}": value
            for rank, metrics in enumerate(self.group.call("memory"))
            for name, value in metrics.items()
        }

    def save_pretrained(self, path: Path) -> None:
        self.group.call("save_pretrained", Path(path))

    def save_adapter(self, path: Path) -> None:
        self.group.call("save_adapter", Path(path))

    def save_state(self, path: Path) -> None:
        self.group.call("save_state", Path(path))

    def load_state(self, path: Path) -> None:
        self.group.call("load_state", Path(path))

    def shutdown(self) -> None:
        self.group.shutdown()


class FSDP2Trainer(FSDP2Ranks):
    """A model of the RL loop on FSDP2 ranks: the policy (`head` a `LogprobHead`, with its frozen reference when
    `load_reference`) or PPO's critic (training/critic.py's `VALUE_HEAD`, a model without LoRA). `actor_fraction`:
    the share of each bundle the ranks take (half where colocated engines take the other half)."""

    def __init__(
        self,
        name: str,
        model: ModelConfig,
        training: TrainingConfig,
        optimizer: OptimizerConfig,
        scheduler: SchedulerConfig,
        cluster: ClusterConfig,
        num_optimizer_steps: int,
        head: Head,
        load_reference: bool = False,
        actor_fraction: float = 1.0,
    ):
        backend_kwargs = dict(
            model_config=model,
            optimizer=optimizer,
            scheduler=scheduler,
            num_optimizer_steps=num_optimizer_steps,
            head=head,
            load_reference=load_reference,
        )
        super().__init__(name, training, cluster, backend_kwargs, actor_fraction)

    def logprobs(self, batch: TrainBatch, reference: bool = False, version: int | None = None) -> torch.Tensor:
        return self.group.call("logprobs", batch, reference, version)[0]

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values [B, T]."""
        return self.group.call("values", batch)[0]

    def keep_version(self, version: int, depth: int) -> list[int]:
        return self.group.call("keep_version", version, depth)[0]

    def transfer_host(self) -> str:
        """The address of the main rank's node, where the refit's transfer group meets."""
        return self.group._bundle_ip(0)

    def host_weight_transfer(self, world_size: int, timeout_s: float) -> int:
        return self.group.call_rank(0, "host_weight_transfer", world_size, timeout_s)

    def join_weight_transfer(self) -> None:
        self.group.call_rank(0, "join_weight_transfer")

    def send_weights(self, layout, bucket_bytes: int, expect=None) -> dict:
        """Every rank gathers, rank 0 sends (training/backend.py `send_weights`): its `SendStats` and expectation."""
        return self.group.call("send_weights", layout, bucket_bytes, expect)[0]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights one decoder layer at a time (`Backend.weight_parts`): the ranks gather a layer from their
        shards and rank 0 hands it over before the next is gathered."""
        for part in range(self.group.call("num_weight_parts")[0]):
            yield from self.group.call("full_state", part)[0]
