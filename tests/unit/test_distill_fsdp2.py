"""The top-k KL of on-policy distillation on the FSDP2 backend: 2 ranks (gloo, real processes) give the loss and
the weights of the single-process torch backend, the student's logprobs at the teacher's ids read from the
sharded model's chunked head."""

import pytest
import torch
from test_distill import TEMPERATURE, ragged, topk_loss
from test_fsdp2_worker import launch

from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.training.fsdp2_worker import FSDP2Worker
from reinforge.training.torch_backend import TorchBackend

NUM_STEPS = 2
TRAINING = TrainingConfig(micro_batch_size=2, global_batch_size=8, lr=1e-3, sequence_packing=True)
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def run_rank(rank, world_size, port, model_dir, out_dir):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    worker = FSDP2Worker(
        rank,
        world_size,
        "127.0.0.1",
        port,
        ModelConfig(name_or_path=str(model_dir)),
        TRAINING,
        temperature=TEMPERATURE,
        num_optimizer_steps=10,
        load_reference=False,
    )
    metrics = [worker.train_step(ragged(), topk_loss) for _ in range(NUM_STEPS)]
    weights = dict(worker.named_weights())
    torch.save({"metrics": metrics, "weights": weights if rank == 0 else None}, out_dir / f"rank{rank}.pt")
    worker.shutdown()


def test_two_fsdp2_ranks_train_the_topk_kl_as_the_torch_backend_does(tiny_model_dir, tmp_path):
    two = launch(2, tiny_model_dir, tmp_path, target=run_rank)
    torch.manual_seed(0)
    backend = TorchBackend(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TRAINING,
        temperature=TEMPERATURE,
        num_optimizer_steps=10,
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
