"""The FSDP2 backend on a CUDA GPU (NCCL, one rank) against the single-process CPU backend in fp32.

Skipped where no GPU is present (CI); run on a lent GPU by `bench/gpu_checks.sh`, which records the
outcome in docs/benchmarks.md. One rank only: two NCCL ranks cannot share one GPU, and two ranks on CPU
are covered by test_fsdp2_worker.py.
"""

from functools import partial

import pytest
import torch
from test_fsdp2_worker import NUM_STEPS, perturb
from test_torch_backend import loss_fn, make_backend, make_batch

from reinforge.algorithms.losses import token_mean
from reinforge.model_config import ModelConfig
from reinforge.network import free_port
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(model_dir, dtype="float32", **training):
    """Logprobs, NUM_STEPS train steps and the final weights of one FSDP2 rank on the GPU."""
    torch.manual_seed(0)
    worker = Backend(
        ModelConfig(name_or_path=str(model_dir), dtype=dtype),
        TrainingConfig(micro_batch_size=2, global_batch_size=8, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(0.7),
        strategy=FSDP2Strategy(0, 1, "127.0.0.1", free_port()),
        load_reference=True,
    )
    try:
        assert worker.device.type == "cuda"
        batch = make_batch()
        logprobs = worker.logprobs(batch)
        perturb(batch, logprobs, worker.logprobs(batch, reference=True))
        metrics = [worker.train_step(batch, partial(loss_fn, token_mean, 0.1)) for _ in range(NUM_STEPS)]
        return logprobs, metrics, dict(worker.named_weights())
    finally:
        worker.shutdown()


@pytest.fixture(scope="module")
def cpu(tiny_model_dir):
    """The same work on the single-process CPU backend, fp32: the reference."""
    backend = make_backend(tiny_model_dir, micro_batch_size=2, load_reference=True, device="cpu")
    batch = make_batch()
    logprobs = backend.logprobs(batch)
    perturb(batch, logprobs, backend.logprobs(batch, reference=True))
    metrics = [backend.train_step(batch, partial(loss_fn, token_mean, 0.1)) for _ in range(NUM_STEPS)]
    return logprobs, metrics, dict(backend.named_weights())


@pytest.mark.parametrize("compile_layers", [False, True])
def test_fp32_on_the_gpu_matches_the_cpu_backend(tiny_model_dir, cpu, compile_layers):
    logprobs, metrics, weights = run(tiny_model_dir, compile=compile_layers)
    print(f"fp32 (compile={compile_layers}) logprobs max |d|:", float((logprobs - cpu[0]).abs().max()))
    torch.testing.assert_close(logprobs, cpu[0], atol=1e-5, rtol=0)
    assert metrics[0]["clip_fraction"] > 0 and metrics[0]["kl"] > 0
    for step in range(NUM_STEPS):
        for name in ("loss", "kl", "entropy", "grad_norm"):
            assert abs(metrics[step][name] - cpu[1][step][name]) <= 1e-5, (
                name,
                step,
                metrics[step][name],
                cpu[1][step][name],
            )
    for name, weight in weights.items():
        torch.testing.assert_close(weight, cpu[2][name], atol=1e-4, rtol=0)


def test_the_torch_backend_trains_on_the_gpu_by_default_and_matches_the_cpu(tiny_model_dir, cpu):
    """training.device=auto puts the single-process backend on the GPU (as configs/grpo_gsm8k.yaml runs)."""
    backend = make_backend(tiny_model_dir, micro_batch_size=2, load_reference=True)
    assert backend.device.type == "cuda" and {p.device.type for p in backend.model.parameters()} == {"cuda"}
    batch = make_batch()
    logprobs = backend.logprobs(batch)
    perturb(batch, logprobs, backend.logprobs(batch, reference=True))
    metrics = [backend.train_step(batch, partial(loss_fn, token_mean, 0.1)) for _ in range(NUM_STEPS)]
    print("torch backend on the GPU, fp32 logprobs max |d|:", float((logprobs - cpu[0]).abs().max()))
    torch.testing.assert_close(logprobs, cpu[0], atol=1e-5, rtol=0)
    for step in range(NUM_STEPS):
        assert abs(metrics[step]["loss"] - cpu[1][step]["loss"]) <= 1e-5, (step, metrics[step], cpu[1][step])


def test_bf16_on_the_gpu_stays_within_bf16_rounding_of_fp32(tiny_model_dir, cpu):
    logprobs, metrics, _ = run(tiny_model_dir, dtype="bfloat16")
    difference = (logprobs - cpu[0]).abs()[make_batch().loss_mask > 0]
    print("bf16 logprobs |d| mean, max:", float(difference.mean()), float(difference.max()))
    assert difference.max() > 0, (
        "bf16 compute gave fp32's logprobs bit for bit: the mixed-precision policy is not applied"
    )
    assert difference.mean() <= 0.01 and difference.max() <= 0.1
    assert abs(metrics[0]["loss"] - cpu[1][0]["loss"]) <= 0.01 * max(1.0, abs(cpu[1][0]["loss"]))


def test_packed_and_padded_batches_agree_on_the_gpu(tiny_model_dir):
    packed, padded = run(tiny_model_dir, sequence_packing=True), run(tiny_model_dir, sequence_packing=False)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    for step in range(NUM_STEPS):
        for name in ("loss", "grad_norm"):
            assert abs(packed[1][step][name] - padded[1][step][name]) <= 1e-5, (name, step)
