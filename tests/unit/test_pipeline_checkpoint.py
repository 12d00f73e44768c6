"""Weights and checkpoints of pipeline stages (training/parallel/pipeline_weights.py, training/state.py) on real gloo
ranks: the full weights at pp=2 are one process's, and a checkpoint moves between pp=2, one process and tp=2.

A Qwen2 of 4 layers with tied embeddings (tests/unit/test_pipeline_parallel.py's) trains GRPO steps on one batch.
In this process one backend takes 2 steps, saves `one/` (and `nested/`, the same state in the format before
pipelines: AdamW's hyperparameters in one list of names) and takes a 3rd: the uninterrupted run. At pp=2 (2 ranks):
(A) the full weights of the fresh model, whole and by weight part, and `save_pretrained`'s export; then 2 steps,
save `pp2/` (each stage writing its own layers), a 3rd step; (B) fresh ranks load `one/`, (C) `nested/`, and take
the 3rd step; then at tp=2 the same 2 processes load `pp2/`, as does a fresh backend in this process. Every 3rd
step's loss, gradient norm, entropy and clip fraction, and its weights, equal the uninterrupted run's to 1e-5.
A LoRA adapter trained a step at pp=2 is written whole (`save_adapter`) and its state resumes in one process. One
module fixture spawns the 2 processes once.
"""

from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_fsdp2_worker import launch
from test_pipeline_parallel import make_batch, tiny_qwen2
from test_torch_backend import loss_fn
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoModelForCausalLM

from reinforge.algorithms.losses import token_mean
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy, gather
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig
from reinforge.training.state import SCHEDULER_FILE

STEP = partial(loss_fn, token_mean, 0.0)  # GRPO's clipped loss: ratios away from 1, AdamW moments
METRICS = ("loss", "grad_norm", "entropy", "clip_fraction")
TIED = ("model.embed_tokens.weight", "lm_head.weight")
LORA = LoraConfig(rank=4, alpha=8.0)
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def make_backend(model_dir, strategy=None, parallel=None, lora=None):
    torch.manual_seed(0)
    training = dict(micro_batch_size=2, global_batch_size=8, sequence_packing=True, share_prompts=True)
    if strategy is not None:
        training |= dict(parallel=ParallelConfig(**parallel), backend="fsdp2", num_workers=strategy.world_size)
    return Backend(
        ModelConfig(name_or_path=str(model_dir), lora=lora),
        TrainingConfig(**training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        strategy=strategy,
    )


def next_step(backend, batch) -> dict:
    """The step, the full weights after it, and the last stage's own copy of the tied LM head (whole)."""
    metrics = backend.train_step(batch, STEP)
    held = backend.model.state_dict(keep_vars=True)
    copy = gather({name: held[name] for name in TIED[1:] if name in held})  # a collective of this stage's ranks
    return {"metrics": metrics, "weights": dict(backend.named_weights()), "lm_head_copy": copy.get(TIED[1])}


def run_rank(rank, world_size, ports, model_dir, out_dir):
    """At pp=2: (A) the full weights, the export, 2 steps, save, a 3rd step; (B) and (C) fresh ranks load `one/` and
    `nested/` and take the 3rd step. Then at tp=2 the same processes load `pp2/` and take it."""
    torch.set_num_threads(1)
    batch = torch.load(out_dir / "batch.pt", weights_only=False)
    strategies = iter(FSDP2Strategy(rank, world_size, "127.0.0.1", port) for port in ports)
    pp2, result = dict(pp=2), {}
    saver = make_backend(model_dir, next(strategies), pp2)
    result["initial"], result["counts"] = dict(saver.named_weights()), saver.num_parameters()
    result["parts"] = [dict(saver.named_weights(part)) for part in range(saver.num_weight_parts())]
    saver.save_pretrained(out_dir / "export")
    for _ in range(2):
        saver.train_step(batch, STEP)
    saver.save_state(out_dir / "pp2")
    result["saved"] = next_step(saver, batch)
    saver.shutdown()
    for parallel, source in ((pp2, "one"), (pp2, "nested"), (dict(tp=2), "pp2")):
        resumed = make_backend(model_dir, next(strategies), parallel)
        resumed.load_state(out_dir / source)
        result[f"from_{source}"] = next_step(resumed, batch)
        resumed.shutdown()
    adapted = make_backend(model_dir, next(strategies), pp2, LORA)  # a LoRA adapter: every stage's in its files
    adapted.train_step(batch, STEP)
    adapted.save_pretrained(out_dir / "adapter_pp2")
    adapted.save_state(out_dir / "lora_pp2")
    adapted.shutdown()
    torch.save(result, out_dir / f"rank{rank}.pt")


def save_nested(backend, path):
    """The trainer state in the format before pipelines: AdamW's state dict as torch gives it, one list of names."""
    model_state, optimizer_state = get_state_dict(backend.model, backend.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path), no_dist=True)
    torch.save(backend.scheduler.state_dict(), path / SCHEDULER_FILE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("pp_checkpoint")
    model_dir = out_dir / "model"
    tiny_qwen2().save_pretrained(model_dir)
    batch = make_batch()
    torch.save(batch, out_dir / "batch.pt")
    one = make_backend(model_dir)
    initial = {name: tensor.clone() for name, tensor in one.named_weights()}
    counts = one.num_parameters()
    for _ in range(2):
        one.train_step(batch, STEP)
    one.save_state(out_dir / "one")
    save_nested(one, out_dir / "nested")
    uninterrupted = next_step(one, batch)
    ranks = launch(2, model_dir, out_dir, target=run_rank, timeout_s=240, num_ports=5)  # one world, both layouts
    resumed = make_backend(model_dir)
    resumed.load_state(out_dir / "pp2")
    adapted = make_backend(model_dir, lora=LORA)
    adapted.train_step(batch, STEP)
    adapted.save_pretrained(out_dir / "adapter_one")
    lora_resumed = make_backend(model_dir, lora=LORA)
    lora_resumed.load_state(out_dir / "lora_pp2")
    return {
        "dir": out_dir,
        "initial": initial,
        "counts": counts,
        "one": uninterrupted,
        "ranks": ranks,
        "in_one_process": next_step(resumed, batch),
        "lora": (next_step(adapted, batch), next_step(lora_resumed, batch)),
    }


def assert_same_step(got: dict, expected: dict) -> None:
    assert expected["metrics"]["clip_fraction"] > 0  # not a trivial step
    for name in METRICS:
        assert abs(got["metrics"][name] - expected["metrics"][name]) <= 1e-5, (name, got["metrics"][name])
    assert list(got["weights"]) == list(expected["weights"])
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, atol=1e-5, rtol=0, msg=name)
    assert got["weights"][TIED[1]].data_ptr() == got["weights"][TIED[0]].data_ptr()  # one tensor, as in one process


def test_full_weights_at_pp2_are_one_process_weights_exactly(runs):
    initial = runs["initial"]
    exported = AutoModelForCausalLM.from_pretrained(runs["dir"] / "export")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight  # the tie written once
    for rank in runs["ranks"]:  # every rank gets every tensor whole, the other stage's broadcast to it
        assert rank["counts"] == runs["counts"]  # every stage's parameters, the tied embedding once
        assert list(rank["initial"]) == list(initial)
        assert rank["initial"][TIED[1]].data_ptr() == rank["initial"][TIED[0]].data_ptr()
        parts = [list(part) for part in rank["parts"]]  # one decoder layer at a time, what is outside them first
        assert parts[0] == [TIED[0], "model.norm.weight", TIED[1]] and len(parts) == 5
        assert all(name.startswith(f"model.layers.{layer}.") for layer in range(4) for name in parts[layer + 1])
        for weights in (rank["initial"], *rank["parts"], exported.state_dict()):
            for name, weight in weights.items():
                assert torch.equal(weight, initial[name]), name


def test_a_checkpoint_saved_at_pp2_resumes_in_one_process_and_at_tp2_with_the_next_step(runs):
    for rank in runs["ranks"]:  # the pp=2 run itself is the one-process run
        assert_same_step(rank["saved"], runs["one"])
        assert_same_step(rank["from_pp2"], runs["one"])  # at tp=2
    assert_same_step(runs["in_one_process"], runs["one"])


def test_a_one_process_checkpoint_resumes_at_pp2_with_both_tied_copies(runs):
    """`nested/` is the format before pipelines: it too restores the last stage's copy of the tied embedding."""
    for source in ("one", "nested"):
        ranks = [rank[f"from_{source}"] for rank in runs["ranks"]]
        for rank in ranks:
            assert_same_step(rank, runs["one"])
        assert ranks[0]["lm_head_copy"] is None  # the first stage holds the embedding only
        torch.testing.assert_close(ranks[1]["lm_head_copy"], runs["one"]["weights"][TIED[0]], atol=1e-5, rtol=0)


def test_each_stage_writes_its_own_layers_under_one_process_names(runs):
    """The pp=2 checkpoint holds the keys a one-process checkpoint holds (AdamW's state of the tied copy under the
    embedding's name), layer 0 in the first stage's file, layer 3 in the last's."""
    keys = {}
    for source in ("pp2", "one"):
        metadata = dcp.FileSystemReader(str(runs["dir"] / source)).read_metadata()
        keys[source] = set(metadata.state_dict_metadata)
        if source == "pp2":
            files = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    assert keys["pp2"] == keys["one"]
    assert "optimizer.state.lm_head.weight.exp_avg" not in keys["pp2"]
    assert files["model.model.layers.0.mlp.up_proj.weight"] == files["model.model.embed_tokens.weight"]
    assert files["model.model.layers.3.mlp.up_proj.weight"] == files["model.lm_head.weight"]
    assert files["model.model.layers.0.mlp.up_proj.weight"] != files["model.model.layers.3.mlp.up_proj.weight"]


def test_a_lora_adapter_at_pp2_is_written_whole_and_its_state_resumes_in_one_process(runs):
    """The main rank's model holds the first stage's LoRA layers only; the adapter file holds every stage's."""
    at_pp2, in_one = (load_file(runs["dir"] / f"adapter_{key}" / "adapter_model.safetensors") for key in ("pp2", "one"))
    assert sorted(at_pp2) == sorted(in_one) and "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight" in in_one
    for name, tensor in in_one.items():
        torch.testing.assert_close(at_pp2[name], tensor, atol=1e-5, rtol=0, msg=name)
    uninterrupted, resumed = runs["lora"]
    for name in METRICS[:3]:
        assert abs(resumed["metrics"][name] - uninterrupted["metrics"][name]) <= 1e-5, name
    for name, weight in uninterrupted["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], weight, atol=1e-5, rtol=0, msg=name)
