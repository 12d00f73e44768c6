"""FSDP2 with LoRA (real gloo worlds in real processes): 2 ranks train the adapter exactly as 1 rank and
as the single-process backend do, the reference is the base with the adapters off, the merged refit
weights and the PEFT export are the trained policy, and a checkpoint holds the adapter and its AdamW
state only, under the single-process backend's names, and restores them exactly."""

from functools import partial

import peft
import pytest
import torch
from test_fsdp2_worker import NUM_STEPS, launch, perturb
from test_torch_backend import loss_fn, make_batch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from reinforge.algorithms.losses import token_mean
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.convert import policy_state_dict
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.lora import adapter_state_dict
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

pytestmark = pytest.mark.xdist_group("fsdp2_worker")

LORA = LoraConfig(rank=4, alpha=8.0)
TRAINING = TrainingConfig(micro_batch_size=2, global_batch_size=8)
LOSS = partial(loss_fn, token_mean, 0.1)


def run_lora_rank(rank, world_size, port, model_dir, out_dir):
    """NUM_STEPS steps, checkpoint and adapter export; then one more step, back to the checkpoint, the same step
    again."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    worker = Backend(
        ModelConfig(name_or_path=str(model_dir), lora=LORA),
        TRAINING,
        OptimizerConfig(lr=1e-2),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(0.7),
        strategy=FSDP2Strategy(rank, world_size, "127.0.0.1", port),
        load_reference=True,
    )
    batch = make_batch()
    perturb(batch, worker.logprobs(batch), worker.logprobs(batch, reference=True))
    metrics = [worker.train_step(batch, LOSS) for _ in range(NUM_STEPS)]
    worker.save_state(str(out_dir / "state"))
    worker.save_adapter(out_dir / "adapter")
    result = {
        "metrics": metrics,
        "weights": dict(worker.named_weights()),
        "logprobs": worker.logprobs(batch),
        "reference": worker.logprobs(batch, reference=True),
        "num_optimized": sum(len(g["params"]) for g in worker.optimizer.param_groups),
    }
    result["next"] = worker.train_step(batch, LOSS), dict(worker.named_weights())
    worker.load_state(str(out_dir / "state"))
    result["next_after_load"] = worker.train_step(batch, LOSS), dict(worker.named_weights())
    torch.save(result, out_dir / f"rank{rank}.pt")
    worker.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """{world_size: (per-rank results, output directory)} for worlds of 1 and 2 ranks."""
    result = {}
    for world_size in (1, 2):
        out_dir = tmp_path_factory.mktemp(f"fsdp2_lora_{world_size}")
        result[world_size] = launch(world_size, tiny_model_dir, out_dir, target=run_lora_rank), out_dir
    return result


def single_process_backend(model_dir) -> Backend:
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir), lora=LORA),
        TRAINING,
        OptimizerConfig(lr=1e-2),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(0.7),
        load_reference=True,
    )


def test_two_ranks_train_the_adapter_as_one_rank_and_the_single_process_backend_do(runs, tiny_model_dir):
    (one,), _ = runs[1]
    two, _ = runs[2]
    backend = single_process_backend(tiny_model_dir)
    batch = make_batch()
    perturb(batch, backend.logprobs(batch), backend.logprobs(batch, reference=True))
    expected = [backend.train_step(batch, LOSS) for _ in range(NUM_STEPS)]
    assert expected[0]["clip_fraction"] > 0 and expected[1]["kl"] > 0
    for step in range(NUM_STEPS):
        for name in ("loss", "pg_loss", "kl", "clip_fraction", "grad_norm"):
            for metrics in (one["metrics"][step], two[0]["metrics"][step], two[1]["metrics"][step]):
                assert abs(metrics[name] - expected[step][name]) <= 1e-5, (name, step)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, weight in backend.named_weights():  # merged: W + (alpha / r) B A; W itself never trained
        for result in (one, two[0]):
            torch.testing.assert_close(result["weights"][name], weight, atol=1e-5, rtol=0)
        assert name.endswith("proj.weight") == bool((weight - initial[name]).abs().max() > 0), name
    assert (
        one["num_optimized"] == two[0]["num_optimized"] == len(backend.trainable) == 2 * 7 * 2
    )  # A and B of 7 linears in each of 2 layers


def test_the_reference_is_the_base_model_with_the_adapters_off(runs, tiny_model_dir):
    two, _ = runs[2]
    base = Backend(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TRAINING,
        OptimizerConfig(lr=1e-2),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(0.7),
        load_reference=False,
    )
    expected = base.logprobs(make_batch())
    torch.testing.assert_close(two[0]["reference"], expected, atol=1e-6, rtol=0)
    assert (two[0]["logprobs"] - expected).abs().max() > 1e-3  # the trained policy is not the base


def test_the_exported_adapter_loads_in_peft_as_the_merged_policy(runs, tiny_model_dir):
    two, out_dir = runs[2]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out_dir / "adapter")
    merged = model.merge_and_unload().state_dict()
    for name, weight in two[0]["weights"].items():
        torch.testing.assert_close(merged[name], weight, atol=1e-6, rtol=0)


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_restores_them_exactly(
    runs, tiny_model_dir, tmp_path
):
    two, out_dir = runs[2]
    state = policy_state_dict(out_dir / "state")  # what reinforge convert reads
    assert set(state) == set(adapter_state_dict(single_process_backend(tiny_model_dir).model))  # its names
    dcp_to_torch_save(str(out_dir / "state"), str(tmp_path / "full.pt"))
    optimizer = torch.load(tmp_path / "full.pt", weights_only=False)["optimizer"]  # state.NAME.exp_avg, ... by name
    assert {key.removeprefix("state.").rsplit(".", 1)[0] for key in optimizer if key.startswith("state.")} == set(state)
    (next_metrics, next_weights), (again_metrics, again_weights) = two[0]["next"], two[0]["next_after_load"]
    assert next_metrics == again_metrics
    for name, weight in next_weights.items():
        assert torch.equal(again_weights[name], weight), name
