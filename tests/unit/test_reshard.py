"""Checkpoints reshard: a trainer state saved under one layout resumes under another with the next step of the
uninterrupted run (training/state.py), with real gloo processes.

One module fixture runs the expensive part once. In this process, one backend trains 2 steps, saves (`one/`), and
takes a 3rd step. Then 2 FSDP2 ranks, in real processes: (A) train 2 steps from the same weights on the same batch,
save (`two/`) and take a 3rd step; (B) fresh ranks load `one/` and take the 3rd step. The tests compare the 3rd
steps: 2 ranks -> one process, one process -> 2 ranks, and each with the uninterrupted run, to 1e-5. A LoRA
adapter's state saved on 2 ranks (tests/unit/test_fsdp2_lora.py's script) resumes in one process the same way.
"""

from functools import partial

import pytest
import torch
from test_fsdp2_lora import LOSS, run_lora_rank, single_process_backend
from test_fsdp2_worker import launch, perturb
from test_torch_backend import loss_fn, make_backend, make_batch

from reinforge.algorithms.losses import token_mean
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.checkpoint import check_compatible
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.state import model_state_dict

STEP = partial(loss_fn, token_mean, 0.1)  # GRPO's clipped loss with a KL term: ratios away from 1, AdamW moments
# on the fsdp2 worker, after the other gloo worlds: the module fixture then runs once, not on both workers
pytestmark = pytest.mark.xdist_group("fsdp2_worker")
METRICS = ("loss", "pg_loss", "kl", "clip_fraction", "entropy", "grad_norm", "lr")


def backend_on_ranks(rank, world_size, port, model_dir):
    """The rank's backend, built like `make_backend(model_dir, micro_batch_size=2)` in one process."""
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=2, global_batch_size=8),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        strategy=FSDP2Strategy(rank, world_size, "127.0.0.1", port),
    )


def run_rank(rank, world_size, ports, model_dir, out_dir):
    """(A) 2 steps, save `two/`, a 3rd step; (B) on fresh ranks: the old format is refused, `one/` loads, a 3rd step."""
    port, second_port = ports
    torch.set_num_threads(1)
    batch = torch.load(out_dir / "batch.pt", weights_only=False)
    saver = backend_on_ranks(rank, world_size, port, model_dir)
    for _ in range(2):
        saver.train_step(batch, STEP)
    saver.save_state(out_dir / "two")
    result = {"saved": saver.train_step(batch, STEP), "saved_weights": dict(saver.named_weights())}
    saver.shutdown()
    resumed = backend_on_ranks(rank, world_size, second_port, model_dir)
    try:
        resumed.load_state(out_dir / "legacy")
    except ConfigError as error:
        result["legacy_error"] = str(error)
    resumed.load_state(out_dir / "one")
    result |= {"resumed": resumed.train_step(batch, STEP), "resumed_weights": dict(resumed.named_weights())}
    torch.save(result, out_dir / f"rank{rank}.pt")
    resumed.shutdown()


def legacy_save(backend, path):
    """The one-process format before checkpoints resharded: one state.pt, AdamW state keyed by parameter index."""
    path.mkdir(parents=True)
    state = {"model": backend.model.state_dict(), "optimizer": backend.optimizer.state_dict()}
    torch.save(state | {"scheduler": backend.scheduler.state_dict()}, path / "state.pt")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("reshard")
    batch = make_batch()
    one = make_backend(tiny_model_dir, micro_batch_size=2, load_reference=True)
    perturb(batch, one.logprobs(batch), one.logprobs(batch, reference=True))
    torch.save(batch, out_dir / "batch.pt")
    one.train_step(batch, STEP)
    legacy_save(one, out_dir / "legacy")  # after step 1
    legacy_next = one.train_step(batch, STEP)
    one.save_state(out_dir / "one")  # after step 2
    uninterrupted = {"metrics": one.train_step(batch, STEP), "weights": dict(one.named_weights())}
    ranks = launch(2, tiny_model_dir, out_dir, target=run_rank, timeout_s=180, num_ports=2)
    return {"dir": out_dir, "batch": batch, "one": uninterrupted, "ranks": ranks, "legacy_next": legacy_next}


def assert_same_step(got: dict, expected: dict, got_weights: dict, expected_weights: dict) -> None:
    assert expected["clip_fraction"] > 0 and expected["kl"] > 0  # the step is not a trivial one
    for name in METRICS:
        assert abs(got[name] - expected[name]) <= 1e-5, (name, got[name], expected[name])
    assert got_weights.keys() == expected_weights.keys()
    for name, weight in expected_weights.items():
        torch.testing.assert_close(got_weights[name], weight, atol=1e-5, rtol=0)


def test_a_state_saved_on_two_fsdp2_ranks_resumes_in_one_process_with_the_next_step(runs, tiny_model_dir):
    resumed = make_backend(tiny_model_dir, micro_batch_size=2)  # fresh weights, empty AdamW moments
    resumed.load_state(runs["dir"] / "two")
    metrics = resumed.train_step(runs["batch"], STEP)
    two = runs["ranks"][0]
    assert_same_step(metrics, two["saved"], dict(resumed.named_weights()), two["saved_weights"])
    # and the 2-rank run itself is the one-process run
    assert_same_step(two["saved"], runs["one"]["metrics"], two["saved_weights"], runs["one"]["weights"])


def test_a_state_saved_in_one_process_resumes_on_two_fsdp2_ranks_with_the_next_step(runs):
    for rank in runs["ranks"]:
        assert_same_step(rank["resumed"], runs["one"]["metrics"], rank["resumed_weights"], runs["one"]["weights"])


def test_the_saved_weights_read_the_same_from_either_layout(runs):
    """What `reinforge convert` reads: the global tensors, whoever wrote them (both hold the 2-step weights)."""
    from_two, from_one = model_state_dict(runs["dir"] / "two"), model_state_dict(runs["dir"] / "one")
    assert from_two.keys() == from_one.keys() and "model.embed_tokens.weight" in from_one
    for name, weight in from_one.items():
        torch.testing.assert_close(from_two[name], weight, atol=1e-5, rtol=0)
    assert sorted(p.name for p in (runs["dir"] / "two").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "numerics.json",  # the non-finite step counters and the finite mark (training/numerics.py)
        "scheduler.pt",
    ]


def test_a_checkpoint_in_the_format_before_resharding_still_resumes_in_one_process(runs, tiny_model_dir):
    resumed = make_backend(tiny_model_dir, micro_batch_size=2)
    resumed.load_state(runs["dir"] / "legacy")
    assert resumed.train_step(runs["batch"], STEP) == runs["legacy_next"]  # bitwise, as before
    assert model_state_dict(runs["dir"] / "legacy").keys() == resumed.model.state_dict().keys()
    way_out = "resume it with training.backend=torch, whose next checkpoint any layout reads"
    assert all(rank["legacy_error"].endswith(way_out) for rank in runs["ranks"])  # FSDP2 ranks name the way out


def test_a_lora_adapter_state_saved_on_two_fsdp2_ranks_resumes_in_one_process_with_the_next_step(
    tiny_model_dir, tmp_path
):
    (two, _), batch = launch(2, tiny_model_dir, tmp_path, target=run_lora_rank), make_batch()
    resumed = single_process_backend(tiny_model_dir)  # fresh adapters (B = 0), empty AdamW moments
    perturb(batch, resumed.logprobs(batch), resumed.logprobs(batch, reference=True))  # as the ranks did, at the start
    resumed.load_state(tmp_path / "state")
    metrics, weights = two["next"]
    assert_same_step(resumed.train_step(batch, LOSS), metrics, dict(resumed.named_weights()), weights)


def test_a_run_may_resume_under_another_layout_but_not_with_another_global_batch(tmp_path):
    saved = {"training": {"backend": "fsdp2", "num_workers": 2, "parallel": {"tp": 1}, "global_batch_size": 32}}
    layouts = [
        {"backend": "torch", "num_workers": 1, "parallel": {"tp": 1}},
        {"backend": "fsdp2", "num_workers": 4, "parallel": {"tp": 2, "dp_shard": 2}},
    ]
    for layout in layouts:
        check_compatible(saved, {"training": saved["training"] | layout}, tmp_path)
    with pytest.raises(ConfigError, match="training.global_batch_size was 32 there and is 64 now"):
        check_compatible(saved, {"training": saved["training"] | {"global_batch_size": 64}}, tmp_path)
