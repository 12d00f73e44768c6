"""Expert parallelism (training/parallel/expert.py) on real gloo ranks equals one process.

A 2-layer Qwen3-MoE with 4 experts (top-2) trains 3 optimizer steps of GRPO's loss in one process and at ep=2 on 2
ranks (dp_shard=2: each rank holds 2 experts and a share of the batch, tokens sent to their experts' rank by
all-to-all); logprobs, the experts' gradients, loss, gradient norm, entropy and every weight (gathered with the
fused names) agree to 1e-5, with and without activation checkpointing, and with ep=2 borrowing context-parallel
ranks (cp=2). The ep=2 run's checkpoint after 2 steps resumes in one process, and one process's on 2 ranks, each
3rd step equal to the uninterrupted run's. One module fixture spawns the world once (~35 s).
"""

from functools import partial

import _shards
import pytest
import torch
from test_fsdp2_worker import launch
from test_torch_backend import loss_fn, make_batch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

from reinforge.algorithms.losses import token_mean
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig, check_layout

NUM_STEPS = 3
METRICS = ("loss", "grad_norm", "entropy", "clip_fraction")
LOSS = partial(loss_fn, token_mean, 0.0)  # GRPO's clipped loss without the KL term
EP2 = ParallelConfig(ep=2)  # dp_shard=2: the 2 ranks hold different rows and different experts
# (name, training settings); each runs on a process group of its own. The context-parallel ranks (cp=2, Ulysses)
# hold different chunks of the same rows: ep borrows them as it borrows FSDP2's data-parallel ranks
SCENARIOS = (
    ("plain", dict(parallel=EP2)),
    ("checkpointed", dict(parallel=EP2, activation_checkpointing=True)),
    ("context", dict(parallel=ParallelConfig(ep=2, cp=2))),
)
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def moe_batch():
    """test_torch_backend's 8 rows (ids in the vocabulary of 64), old logprobs away from the policy's: the clip is
    active."""
    batch = make_batch()
    noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs = noise * batch.loss_mask
    return batch


def make_backend(model_dir, strategy=None, **training):
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=2, global_batch_size=8, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        strategy=strategy,
    )


def expert_gradients(backend, batch):
    """The experts' weight gradients of the loss on `batch`, whole (AdamW's steps hardly depend on the gradients'
    scale, so the weights alone would not show a wrong one)."""
    backend.optimizer.zero_grad(set_to_none=True)
    backend.accumulate_gradients(batch, LOSS)
    parameters = [(name, p) for name, p in backend.model.named_parameters() if ".experts." in name]
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for name, p in parameters}
    backend.optimizer.zero_grad(set_to_none=True)
    return grads


def train(backend, num_steps, save_after=None, save_to=None):
    """`num_steps` steps on `moe_batch` (the state saved to `save_to` after `save_after` of them): logprobs and the
    experts' gradients before training, each step's metrics, the weights after."""
    batch = moe_batch()
    # what this rank holds (before a forward: FSDP2 leaves the root's parameters whole after one) and receives
    held, seen = _shards.held(backend.model), _shards.watch_inputs(backend.model)
    logprobs = backend.logprobs(batch)
    routing = {"rows": _shards.micro_batch_rows(backend, batch), "inputs": _shards.inputs_record(seen)}
    grads = expert_gradients(backend, batch)
    metrics = []
    for step in range(num_steps):
        if step == save_after:
            backend.save_state(save_to)
        metrics.append(backend.train_step(batch, LOSS))
    weights = dict(backend.named_weights())
    return {"logprobs": logprobs, "grads": grads, "metrics": metrics, "weights": weights, "held": held} | routing


def run_rank(rank, world_size, ports, model_dir, out_dir):
    """Each scenario at ep=2 (the plain one saving its state after 2 steps), then the one-process checkpoint resumed
    for a 3rd step."""
    torch.set_num_threads(1)
    training = dict(backend="fsdp2", num_workers=world_size)
    results = {}
    for port, (name, settings) in zip(ports, SCENARIOS + (("resumed", dict(parallel=EP2)),), strict=True):
        backend = make_backend(model_dir, FSDP2Strategy(rank, world_size, "127.0.0.1", port), **training, **settings)
        if name == "resumed":
            backend.load_state(out_dir / "one_state")
            results[name] = train(backend, 1)
        else:
            save_after = 2 if name == "plain" else None
            results[name] = train(backend, NUM_STEPS, save_after, out_dir / "ep2_state")
        experts = backend.model.model.layers[0].mlp.experts.gate_up_proj
        forward = backend.model.model.layers[0].mlp.experts.forward.__name__
        results[name]["experts_held"] = (tuple(experts.device_mesh.mesh_dim_names), experts.to_local().shape, forward)
        backend.shutdown()
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tiny_moe_model_dir, tmp_path_factory):
    """{"one": one process's run (its state saved after 2 steps), "ep2": each rank's results per scenario,
    "resumed_here": the ep=2 checkpoint's 3rd step in one process}."""
    model_dir, out_dir = tiny_moe_model_dir, tmp_path_factory.mktemp("ep")
    results = {"model_dir": model_dir, "one": train(make_backend(model_dir), NUM_STEPS, 2, out_dir / "one_state")}
    results["ep2"] = launch(2, model_dir, out_dir, target=run_rank, timeout_s=240, num_ports=len(SCENARIOS) + 1)
    resumed = make_backend(model_dir)
    resumed.load_state(out_dir / "ep2_state")
    results["resumed_here"] = train(resumed, 1)
    return results


def assert_same_step(ranked, expected):
    for name in METRICS:
        assert abs(ranked[name] - expected[name]) <= 1e-5, (name, ranked[name], expected[name])


@pytest.mark.parametrize("scenario", [name for name, _ in SCENARIOS])
def test_expert_parallel_training_equals_one_process(runs, scenario):
    one = runs["one"]
    assert one["metrics"][0]["grad_norm"] > 0 and one["metrics"][0]["clip_fraction"] > 0
    for rank, result in enumerate(runs["ep2"]):
        ranked = result[scenario]
        torch.testing.assert_close(ranked["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        assert ranked["grads"].keys() == one["grads"].keys() and len(one["grads"]) == 4
        for name, grad in one["grads"].items():  # the sum over every rank's tokens, as in one process
            torch.testing.assert_close(ranked["grads"][name], grad, atol=1e-5 * grad.abs().max().item(), rtol=0)
        for step in range(NUM_STEPS):
            assert_same_step(ranked["metrics"][step], one["metrics"][step])
        assert ranked["weights"].keys() == one["weights"].keys()
        for name, weight in one["weights"].items():
            torch.testing.assert_close(ranked["weights"][name], weight, atol=1e-5, rtol=0, msg=name)
        # each rank holds 2 of the 4 experts (FSDP2's shard dimension beside ep has one rank), tokens dispatched
        assert ranked["experts_held"] == (("edp_shard", "ep"), (2, 64, 64), "_dispatched_forward")
    initial = AutoModelForCausalLM.from_pretrained(runs["model_dir"]).state_dict()
    experts = runs["ep2"][0][scenario]["weights"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape == initial["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    for name, weight in one["weights"].items():
        assert (weight - initial[name]).abs().max() > 0, f"{name} was not updated"


@pytest.mark.parametrize("scenario", [*(name for name, _ in SCENARIOS), "resumed"])
def test_each_rank_holds_its_experts_and_gets_its_rows(runs, scenario):
    """The experts Shard(0) over ep (2 of 4 per rank), every other weight FSDP2-sharded over dp_shard x cp; at
    dp_shard=2 the ranks train different rows, at cp=2 the same rows in different chunks (_shards.py)."""
    one = runs["one"]
    shapes = {name: shape for name, (_, _, shape, _) in one["held"].items()}
    assert one["held"] == _shards.plain(shapes)
    parallel = dict(SCENARIOS).get(scenario, dict(parallel=EP2))["parallel"]
    grid = _shards.Layout(dp_shard=parallel.resolved(2).dp_shard, cp=parallel.cp, ep=parallel.ep)
    ranks = [result[scenario] for result in runs["ep2"]]
    for rank, result in enumerate(ranks):
        expected = _shards.expected_held(shapes, grid, rank, head_dim=32)
        _shards.assert_held(result["held"], expected, f"{scenario} rank {rank}")
        experts = result["held"]["model.layers.1.mlp.experts.down_proj"]
        assert experts == (("edp_shard", "ep"), ("S0", "S0"), (4, 64, 32), (2, 64, 32)), experts
    _shards.assert_routing([r["rows"] for r in ranks], [r["inputs"] for r in ranks], grid, len(moe_batch()))


def test_an_expert_parallel_checkpoint_resumes_in_one_process_and_back(runs):
    uninterrupted = runs["ep2"][0]["plain"]["metrics"][2]
    assert_same_step(runs["resumed_here"]["metrics"][0], uninterrupted)
    for rank in range(2):  # one process's checkpoint after 2 steps, resumed at ep=2
        assert_same_step(runs["ep2"][rank]["resumed"]["metrics"][0], runs["one"]["metrics"][2])
    for name, weight in runs["one"]["weights"].items():
        torch.testing.assert_close(runs["resumed_here"]["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def test_an_expert_layout_the_model_cannot_take_is_a_one_line_error_naming_the_nearest():
    moe = Qwen3MoeConfig(num_experts=6)
    with pytest.raises(ConfigError, match="must divide the model's experts \\(6\\).*nearest valid ep is 3"):
        check_layout(ParallelConfig(ep=4, dp_shard=12), moe)
    with pytest.raises(ConfigError, match="dp_shard x cp ranks \\(4\\).*nearest valid ep is 2"):
        check_layout(ParallelConfig(ep=3, dp_shard=4), moe)
    with pytest.raises(ConfigError, match="qwen2 is a dense model; set training.parallel.ep=1"):
        check_layout(ParallelConfig(ep=2, dp_shard=2), Qwen2Config())
    with pytest.raises(ConfigError, match="must divide dp_shard x cp = 6 x 1.*nearest valid ep is 3"):
        ParallelConfig(ep=4).resolved(6)
    assert ParallelConfig(ep=2, cp=2).resolved(2).dp_shard == 1  # ep borrows the cp ranks: no more ranks
    check_layout(ParallelConfig(ep=2, dp_shard=4), moe)
