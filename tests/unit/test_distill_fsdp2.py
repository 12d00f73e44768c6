"""The top-k KL of on-policy distillation on the FSDP2 backend: 2 ranks (gloo, real processes) give the loss and
the weights of the single-process backend, the student's logprobs at the teacher's ids read from the
sharded model's chunked head."""

import pytest
import torch
from test_distill import TEMPERATURE, ragged, topk_loss
from test_fsdp2_worker import launch

from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

NUM_STEPS = 2
TRAINING = TrainingConfig(micro_batch_size=2, global_batch_size=8, sequence_packing=True)
# Renormalised over the top k, the KL's gradient at a token in no position's top k is exactly 0 (the full
# vocabulary's normaliser cancels), so what reaches it is rounding (~1e-10) in an order that differs with the
# micro-batching, which AdamW with eps 1e-8 would blow up to steps of ~1e-5; eps 1e-6 keeps such steps at ~1e-7.
OPTIMIZER = OptimizerConfig(lr=1e-3, adam_eps=1e-6)
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def run_rank(rank, world_size, port, model_dir, out_dir):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    worker = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TRAINING,
        OPTIMIZER,
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(TEMPERATURE),
        strategy=FSDP2Strategy(rank, world_size, "127.0.0.1", port),
        load_reference=False,
    )
    metrics = [worker.train_step(ragged(), topk_loss) for _ in range(NUM_STEPS)]
    weights = dict(worker.named_weights())
    torch.save({"metrics": metrics, "weights": weights if rank == 0 else None}, out_dir / f"rank{rank}.pt")
    worker.shutdown()


def test_two_fsdp2_ranks_train_the_topk_kl_as_the_single_process_backend_does(tiny_model_dir, tmp_path):
    two = launch(2, tiny_model_dir, tmp_path, target=run_rank)
    torch.manual_seed(0)
    backend = Backend(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TRAINING,
        OPTIMIZER,
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(TEMPERATURE),
        load_reference=False,
    )
    for step in range(NUM_STEPS):
        metrics = backend.train_step(ragged(), topk_loss)
        assert metrics["loss"] > 0
        for rank in range(2):
            assert abs(two[rank]["metrics"][step]["loss"] - metrics["loss"]) <= 1e-5, (step, rank)
            assert abs(two[rank]["metrics"][step]["grad_norm"] - metrics["grad_norm"]) <= 1e-5, (step, rank)
    for name, weight in backend.named_weights():
        torch.testing.assert_close(two[0]["weights"][name], weight, atol=1e-5, rtol=0)
