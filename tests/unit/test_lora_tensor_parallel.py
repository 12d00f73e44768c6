"""LoRA under tensor parallelism (training/parallel/lora_tensor.py) on real gloo ranks equals one process.

The tiny Qwen2 of test_tensor_parallel.py (4 heads, 2 kv heads, q/k/v biases) with adapters on every attention
and MLP projection trains 3 GRPO steps (clip and KL active, the reference the adapters switched off) in one
process and at tp=2 (2 ranks): logprobs, loss, gradient norm, the adapters and the merged weights agree to 1e-5
(dp_shard x tp is test_tensor_parallel.py's, for the base model). Each adapter matrix is split with its base
layer (A replicated and B on its rows beside a column-wise base; A on its columns and B replicated beside a
row-wise one), as placements and local shapes on every rank show; a checkpoint written at tp=2 resumes in one
process, and one written in one process resumes at tp=2, the next step equal to the uninterrupted run's. One
module fixture spawns the world once.
"""

from functools import partial

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp2_worker import launch, perturb
from test_tensor_parallel import make_batch, make_model_dir
from test_torch_backend import loss_fn
from torch.distributed.tensor import DTensor, Replicate, Shard

from reinforge.algorithms.losses import token_mean
from reinforge.errors import ConfigError
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy, gather
from reinforge.training.heads import LogprobHead
from reinforge.training.lora import adapter_state_dict
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig
from reinforge.training.parallel.lora_tensor import check_lora_dropout

pytestmark = pytest.mark.xdist_group("fsdp2_worker")

NUM_STEPS = 3
LOSS = partial(loss_fn, token_mean, 0.1)
PARALLEL = dict(tp=2)
COLUMN_WISE, ROW_WISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")


def make_backend(model_dir, strategy=None, parallel=None) -> Backend:
    torch.manual_seed(0)
    training = dict(micro_batch_size=2, global_batch_size=8, sequence_packing=True, share_prompts=True)
    if strategy is not None:
        training |= dict(backend="fsdp2", num_workers=strategy.world_size, parallel=ParallelConfig(**parallel))
    return Backend(
        ModelConfig(name_or_path=str(model_dir), lora=LoraConfig(rank=4, alpha=8.0)),
        TrainingConfig(**training),
        OptimizerConfig(lr=1e-2),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        strategy=strategy,
        load_reference=True,
    )


def perturbed_batch(backend):
    batch = make_batch()
    perturb(batch, backend.logprobs(batch), backend.logprobs(batch, reference=True))
    return batch


def adapter(backend) -> dict[str, torch.Tensor]:
    """The whole adapter matrices, copied (on CPU `gather` may hand back a replicated parameter's own storage)."""
    return {name: tensor.clone() for name, tensor in gather(adapter_state_dict(backend.model)).items()}


def shards(backend) -> dict[str, tuple]:
    """Each adapter matrix's (placement on the tp mesh dimension, local shape, full shape) on this rank."""
    found = {}
    for name, param in zip(backend.trainable_names, backend.trainable, strict=True):
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names[-1] == "tp", name
        found[name] = (param.placements[-1], tuple(param.to_local().shape), tuple(param.shape))
    return found


def run_rank(rank, world_size, port, model_dir, out_dir, parallel):
    """3 steps; at tp=2 the checkpoint and the PEFT export, then one process's checkpoint of step 1 and the step
    after it."""
    torch.set_num_threads(1)
    backend = make_backend(model_dir, FSDP2Strategy(rank, world_size, "127.0.0.1", port), parallel)
    batch = perturbed_batch(backend)
    result = {"logprobs": backend.logprobs(batch), "shards": shards(backend)}
    result["metrics"] = [backend.train_step(batch, LOSS) for _ in range(NUM_STEPS)]
    result["adapter"] = adapter(backend)
    result["weights"] = dict(backend.named_weights())
    backend.save_state(out_dir / "state")
    backend.save_adapter(out_dir / "adapter")
    backend.load_state(out_dir.parent / "one_state1")
    result["after_load"] = backend.train_step(batch, LOSS)
    backend.shutdown()
    torch.save(result, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"one": one process's results, with its 4th step; "tp2": every rank's results and their directory}."""
    base = tmp_path_factory.mktemp("lora_tp")
    model_dir = make_model_dir(base / "model", "sdpa")
    backend = make_backend(model_dir)
    batch = perturbed_batch(backend)
    one = {"logprobs": backend.logprobs(batch), "metrics": [backend.train_step(batch, LOSS)]}
    backend.save_state(base / "one_state1")
    one["metrics"] += [backend.train_step(batch, LOSS) for _ in range(NUM_STEPS - 1)]
    one["adapter"] = adapter(backend)
    one["weights"] = dict(backend.named_weights())
    one["next"] = backend.train_step(batch, LOSS)
    results = {"one": one, "model_dir": model_dir}
    (base / "tp2").mkdir()
    results["tp2"] = launch(2, model_dir, base / "tp2", PARALLEL, target=run_rank, timeout_s=300), base / "tp2"
    return results


def test_lora_at_tp2_trains_as_one_process(runs):
    one, (ranks, _) = runs["one"], runs["tp2"]
    assert one["metrics"][0]["clip_fraction"] > 0 and one["metrics"][1]["kl"] > 0
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        for step in range(NUM_STEPS):
            for name in ("loss", "pg_loss", "kl", "grad_norm", "entropy"):
                assert abs(result["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (rank, step, name)
        assert result["adapter"].keys() == one["adapter"].keys()
        for name, tensor in one["adapter"].items():
            assert ".lora_B." not in name or tensor.abs().max() > 0, f"{name} was not trained"
            torch.testing.assert_close(result["adapter"][name], tensor, atol=1e-5, rtol=0, msg=name)
    assert ranks[0]["weights"].keys() == one["weights"].keys()
    for name, weight in one["weights"].items():  # merged: W + (alpha / r) B A, under the Hugging Face names
        torch.testing.assert_close(ranks[0]["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def test_each_adapter_is_split_with_its_base_layer(runs):
    ranks, _ = runs["tp2"]
    for result in ranks:
        assert len(result["shards"]) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
        for name, (placement, local_shape, shape) in result["shards"].items():
            module, matrix = name.split(".")[-4], name.split(".")[-3]
            assert module in COLUMN_WISE + ROW_WISE, name
            split = {"lora_A": Shard(1), "lora_B": Replicate()} if module in ROW_WISE else {"lora_B": Shard(0)}
            expected = split.get(matrix, Replicate())
            assert placement == expected, (name, placement)
            tp_parts = 1 if expected == Replicate() else 2
            assert torch.Size(local_shape).numel() * tp_parts == torch.Size(shape).numel(), (name, local_shape)
            if isinstance(expected, Shard):
                assert local_shape[expected.dim] == shape[expected.dim] // 2, (name, local_shape)


def test_checkpoints_and_the_peft_export_move_between_tp2_and_one_process(runs):
    """The ranks resumed one process's step-1 checkpoint and took step 2; one process resumes the ranks' step-3
    checkpoint and takes step 4; the PEFT export written at tp=2 holds one process's whole adapters."""
    one, (ranks, out_dir) = runs["one"], runs["tp2"]
    for result in ranks:
        metrics = result["after_load"]
        for name in ("loss", "kl", "grad_norm"):
            assert abs(metrics[name] - one["metrics"][1][name]) <= 1e-5, name
    resumed = make_backend(runs["model_dir"])
    batch = perturbed_batch(resumed)
    resumed.load_state(out_dir / "state")
    metrics = resumed.train_step(batch, LOSS)
    for name in ("loss", "kl", "grad_norm"):
        assert abs(metrics[name] - one["next"][name]) <= 1e-5, name
    exported = load_file(out_dir / "adapter" / "adapter_model.safetensors")
    assert len(exported) == len(one["adapter"])
    for name, tensor in one["adapter"].items():  # PEFT drops the adapter's name from its file's keys
        key = "base_model.model." + name.replace(".default.", ".")
        torch.testing.assert_close(exported[key], tensor, atol=1e-5, rtol=0, msg=name)


def test_lora_dropout_under_tp_is_a_one_line_error():
    with pytest.raises(ConfigError, match="model.lora.dropout=0.05 with training.parallel.tp=2"):
        check_lora_dropout(2, 0.05)
    check_lora_dropout(1, 0.05)
    check_lora_dropout(2, 0.0)
