"""A vision-language model under tensor and context parallelism on real gloo ranks equals one process.

The tiny Idefics3 (conftest's `tiny_vlm_dir`: a 2-layer Llama text model with 2 heads, a 2-layer vision tower, 4
image tokens per picture) trains 3 optimizer steps of GRPO's loss on image prompts, its vision tower trained too
(`freeze_vision=false`), in one process, at tp=2 packed with shared prompts, and at cp=2 packed with shared
prompts and unpacked (2 ranks each). Logprobs, loss, gradient norm, entropy and every weight after the steps
agree to 1e-5. Each rank also records what it holds: at tp=2 a decoder projection is a tp-sharded DTensor of half
the rows and the vision tower is not split over tp; at cp=2 the model takes whole rows (every image's features
merged) and its decoder half of them. One module fixture spawns each world once.

AdamW's eps is 1e-6: the vision attention's key bias has no gradient in exact arithmetic (softmax ignores a shift
shared by every key), and with eps=1e-8 Adam turns its rounding noise into steps that differ between layouts.
"""

from functools import partial

import pytest
import torch
from test_fsdp2_worker import launch
from test_torch_backend import loss_fn
from test_vlm import png, prompts_of, rollout_batch
from torch.distributed.tensor import DTensor, Shard

from reinforge.algorithms.losses import token_mean
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig

NUM_STEPS = 3
METRICS = ("loss", "grad_norm", "entropy")
SCENARIOS = (  # (name, training settings)
    ("shared", dict(sequence_packing=True, share_prompts=True)),
    ("padded", dict(sequence_packing=False)),
)
LAYOUTS = (("tp2", dict(tp=2)), ("cp2", dict(cp=2)))  # (key, training.parallel), 2 ranks each
RUNS = {"tp2": ("shared",), "cp2": ("shared", "padded")}  # the scenarios each layout runs
PROJECTION = "model.text_model.layers.0.self_attn.q_proj.weight"
VISION = "model.vision_model.encoder.layers.0.mlp.fc1.weight"
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def make_batch(data_path, model_dir):
    """Two samples of each of four image prompts; old logprobs away from the policy's, so the clip is active."""
    batch = rollout_batch(prompts_of(model_dir, data_path), samples=2)
    gen = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(len(batch), generator=gen).unsqueeze(1) * batch.loss_mask
    batch.old_logprobs = 0.3 * torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    return batch


def widths(model):
    """Hooks recording each forward's (width of the model's input ids, width of its decoder's output)."""
    seen, inputs = [], []
    record = lambda module, args, kwargs: inputs.append(kwargs["input_ids"].shape[1])  # noqa: E731
    model.register_forward_pre_hook(record, with_kwargs=True)
    model.get_decoder().register_forward_hook(lambda m, args, out: seen.append((inputs[-1], out[0].shape[1])))
    return seen


def shards(model):
    """(placements, local shape, full shape) of the decoder projection and of a vision tower weight."""
    params = dict(model.named_parameters())
    return {
        name: (tuple(params[name].placements), tuple(params[name].to_local().shape), tuple(params[name].shape))
        for name in (PROJECTION, VISION)
        if isinstance(params[name], DTensor)
    } | {f"{name}.mesh": params[name].device_mesh.mesh_dim_names for name in (PROJECTION, VISION)}


def run_scenario(strategy, model_dir, data_path, training):
    torch.manual_seed(0)
    backend = Backend(
        ModelConfig(name_or_path=str(model_dir), freeze_vision=False),
        TrainingConfig(micro_batch_size=2, global_batch_size=8, **training),
        OptimizerConfig(lr=1e-3, adam_eps=1e-6),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        strategy=strategy,
    )
    seen = widths(backend.model)
    held = shards(backend.model) if strategy is not None else {}
    batch = make_batch(data_path, model_dir)
    logprobs = backend.logprobs(batch)
    metrics = [backend.train_step(batch, partial(loss_fn, token_mean, 0.0)) for _ in range(NUM_STEPS)]
    weights = dict(backend.named_weights())
    backend.shutdown()
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights, "widths": seen, "shards": held}


def run_rank(rank, world_size, ports, model_dir, out_dir, data_path, parallel):
    torch.set_num_threads(1)
    results = {}
    layout = next(key for key, layout_parallel in LAYOUTS if layout_parallel == parallel)
    scenarios = [(name, training) for name, training in SCENARIOS if name in RUNS[layout]]
    ports = ports if isinstance(ports, list) else [ports]  # launch hands one port as it is
    for port, (name, training) in zip(ports, scenarios, strict=True):
        strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
        training = dict(training, parallel=ParallelConfig(**parallel), backend="fsdp2", num_workers=world_size)
        results[name] = run_scenario(strategy, model_dir, data_path, training)
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tiny_vlm_dir, tmp_path_factory):
    """{"one": one process's results per scenario, each layout: every rank's per scenario, "initial": weights}."""
    base = tmp_path_factory.mktemp("vlm_parallel")
    (base / "images").mkdir()
    records = []
    for index in range(4):  # four prompts of one text, each its own picture
        (base / "images" / f"{index}.png").write_bytes(png(10 + index))
        records.append(f'{{"prompt": "add the numbers", "images": ["images/{index}.png"], "answer": "{index}"}}\n')
    data_path = base / "train.jsonl"
    data_path.write_text("".join(records))
    results = {name: run_scenario(None, tiny_vlm_dir, data_path, training) for name, training in SCENARIOS}
    results = {"one": results}
    for key, parallel in LAYOUTS:
        out_dir = base / key
        out_dir.mkdir()
        results[key] = launch(
            2, tiny_vlm_dir, out_dir, data_path, parallel, target=run_rank, timeout_s=240, num_ports=len(RUNS[key])
        )
    return results


@pytest.mark.parametrize("layout, scenario", [(key, name) for key, _ in LAYOUTS for name in RUNS[key]])
def test_a_vlm_under_tensor_or_context_parallelism_trains_as_one_process(runs, layout, scenario):
    one = runs["one"][scenario]
    assert one["metrics"][0]["grad_norm"] > 0 and one["logprobs"].abs().max() > 0
    for rank, result in enumerate(runs[layout]):
        ranked = result[scenario]
        torch.testing.assert_close(ranked["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        for step in range(NUM_STEPS):
            for name in METRICS:
                assert abs(ranked["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (rank, step, name)
    weights = runs[layout][0][scenario]["weights"]
    assert weights.keys() == one["weights"].keys()
    for name, weight in one["weights"].items():
        torch.testing.assert_close(weights[name], weight, atol=1e-5, rtol=0, msg=name)


def test_every_weight_moves_the_vision_tower_included(runs, tiny_vlm_dir):
    from reinforge.modeling import load_model

    initial = load_model(ModelConfig(name_or_path=str(tiny_vlm_dir))).state_dict()
    for name, weight in runs["one"]["shared"]["weights"].items():
        if name in initial:
            assert (weight - initial[name]).abs().max() > 0, f"{name} was not updated"


@pytest.mark.parametrize("scenario", RUNS["tp2"])
def test_tensor_parallel_ranks_hold_half_of_each_decoder_projection_and_all_of_the_vision_tower(runs, scenario):
    for rank in runs["tp2"]:
        held = rank[scenario]["shards"]
        placements, local, full = held[PROJECTION]
        assert "tp" in held[f"{PROJECTION}.mesh"] and placements[-1] == Shard(0), held
        assert local == (full[0] // 2, full[1]), held
        assert "tp" not in held[f"{VISION}.mesh"], held  # replicated over tp (FSDP2 shards it over dp only)
        assert all(model == decoder for model, decoder in rank[scenario]["widths"]), "tp gathers the decoder's output"


@pytest.mark.parametrize("scenario", RUNS["cp2"])
def test_context_parallel_ranks_merge_images_into_whole_rows_and_decode_half(runs, scenario):
    for rank in runs["cp2"]:
        seen = rank[scenario]["widths"]
        assert seen and all(model == 2 * decoder for model, decoder in seen), seen
