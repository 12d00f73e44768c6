"""Numerical faults (training/numerics.py): the skip decision against hand-computed cases, the backend skipping a
step whose loss or gradient is NaN (no update, no schedule step, counted) and stopping at the limit or at once for a
non-finite parameter, checkpoints' `finite` mark in pruning and resume, and the HF engine's one-line error."""

import json
import math

import pytest
import torch

from reinforge.errors import NumericalError
from reinforge.generation.hf import check_finite_logits
from reinforge.training.checkpoint import is_finite, latest_checkpoint, prune, save_checkpoint
from reinforge.training.numerics import (
    NONE,
    Fault,
    NonfiniteSteps,
    first_nonfinite,
    loss_code,
    step_fault,
)
from tests.unit.test_torch_backend import make_backend, make_batch

NAN, INF = float("nan"), float("inf")


def test_the_skip_decision_names_the_first_non_finite_micro_batch_and_its_rank():
    # two ranks: rank 0's micro-batches 0..2 have losses (1, 2, inf), rank 1's (1, nan, nan)
    rank0 = loss_code([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(INF)], rank=0, world_size=2)
    rank1 = loss_code([torch.tensor(1.0), torch.tensor(NAN), torch.tensor(NAN)], rank=1, world_size=2)
    assert (int(rank0), int(rank1)) == (2 * 2 + 0, 1 * 2 + 1)  # micro * world_size + rank
    least = min(int(rank0), int(rank1))  # what all_min gives every rank
    assert step_fault(least, True, world_size=2) == Fault("loss", "micro-batch 1 of rank 1")
    # the loss first: a non-finite loss makes the gradient norm non-finite too
    assert step_fault(least, False, world_size=2, grad_owner="w") == Fault("loss", "micro-batch 1 of rank 1")
    assert loss_code([torch.tensor(1.0)], rank=0, world_size=1) == NONE
    assert step_fault(NONE, False, 1, "lm_head.weight") == Fault(
        "gradient norm", "the first non-finite gradient: lm_head.weight"
    )
    assert step_fault(NONE, False, 1) == Fault("gradient norm", "every gradient is finite")  # their norm overflowed
    assert step_fault(NONE, True, 1) is None


def test_first_nonfinite_finds_nan_and_inf_and_weights_whose_squares_overflow():
    assert int(first_nonfinite([torch.full((1000,), 1e17), torch.zeros(0), torch.tensor([-1.0, 2.0])])) == NONE
    tensors = [torch.ones(2), torch.zeros(0), torch.tensor([1.0, -INF]), torch.tensor([NAN])]
    assert int(first_nonfinite(tensors)) == 2
    assert int(first_nonfinite(tensors, owners=[0, 0, 7, 1])) == 1  # the least owner: the parameter first in order
    # optimizer.lr=1e30 makes every weight about 1e30 in one AdamW step: finite, but the next forward cannot be
    assert int(first_nonfinite([torch.ones(2), torch.full((2,), 1e30)])) == 1
    assert int(first_nonfinite([torch.full((2,), 3e38)], norm_type=INF)) == NONE  # a moment: finite is enough


def test_the_limit_counts_skipped_steps_in_a_row(tmp_path):
    steps = NonfiniteSteps(limit=3)
    fault = Fault("loss", "micro-batch 0")
    steps.skip(4, fault)
    steps.skip(5, fault)
    steps.finite()  # a finite step breaks the row
    steps.skip(7, fault)
    steps.save(tmp_path)
    assert json.loads((tmp_path / "numerics.json").read_text())["finite"] is False  # saved mid-row: suspect
    steps.skip(8, fault)
    with pytest.raises(NumericalError, match=r"^training stopped at step 9: the loss is non-finite \(micro-batch 0\)"):
        steps.skip(9, fault)
    assert (steps.skipped, steps.in_a_row) == (5, 3)
    restored = NonfiniteSteps(limit=3)
    restored.load(tmp_path)
    assert (restored.skipped, restored.in_a_row) == (3, 1)


def nan_on_micro(index: int):
    """A loss function whose micro-batch `index` (of size 2) has a NaN loss; the others a finite one."""
    calls = []

    def loss_fn(logprobs, micro, norm):
        loss = -(logprobs * micro.loss_mask).sum() / norm.num_tokens
        if len(calls) == index:
            loss = loss * NAN
        calls.append(1)
        return loss, {"loss": loss.detach()}

    return loss_fn


def test_a_non_finite_step_is_skipped_counted_and_stops_at_the_limit(tiny_model_dir):
    backend = make_backend(tiny_model_dir, micro_batch_size=2, max_nonfinite_steps=2)
    batch = make_batch()
    before = [p.detach().clone() for p in backend.trainable]
    metrics = backend.train_step(batch, nan_on_micro(1), step=3)
    assert math.isnan(metrics["loss"]) and metrics["nonfinite_steps"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, backend.trainable))  # no update
    assert backend.scheduler.last_epoch == 0 and not backend.optimizer.state  # no step, no schedule advance
    assert all(p.grad is None for p in backend.trainable)
    metrics = backend.train_step(batch, nan_on_micro(-1), step=4)  # a finite one: trained, the row broken
    assert metrics["nonfinite_steps"] == 1.0 and backend.scheduler.last_epoch == 1
    assert backend.nonfinite.in_a_row == 0
    backend.train_step(batch, nan_on_micro(0), step=5)
    with pytest.raises(NumericalError, match=r"step 6: the loss is non-finite \(micro-batch 2\).*in a row: 2"):
        backend.train_step(batch, nan_on_micro(2), step=6)


def test_the_fault_hook_makes_a_steps_gradients_nan(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("REINFORGE_FAULT_NONFINITE_AT_STEP", "2")
    backend = make_backend(tiny_model_dir, micro_batch_size=8, max_nonfinite_steps=1)
    batch = make_batch()
    backend.train_step(batch, nan_on_micro(-1), step=1)
    name = backend.trainable_names[0]
    with pytest.raises(NumericalError, match=rf"step 2: the gradient norm is non-finite \(.*{name}\)"):
        backend.train_step(batch, nan_on_micro(-1), step=2)


def test_a_nan_gradient_of_one_parameter_is_named_though_clipping_spreads_it(tiny_model_dir):
    backend = make_backend(tiny_model_dir, micro_batch_size=4, max_nonfinite_steps=1)  # max_grad_norm 1: clipping on
    name, param = backend.trainable_names[5], backend.trainable[5]
    param.register_hook(lambda grad: grad * NAN)  # a backward that overflowed in this one parameter
    with pytest.raises(
        NumericalError, match=rf"the gradient norm is non-finite \(the first non-finite gradient: {name}\)"
    ):
        backend.train_step(make_batch(), nan_on_micro(-1), step=1)


def test_a_step_that_leaves_a_parameter_non_finite_stops_at_once_and_nothing_is_saved(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir, micro_batch_size=8)
    backend.optimizer.param_groups[0]["lr"] = 1e30  # one AdamW step makes every trained weight about 1e30
    with pytest.raises(NumericalError, match=r"step 1: the parameter \S+ is non-finite \(or so large that its square"):
        backend.train_step(make_batch(), nan_on_micro(-1), step=1)
    with pytest.raises(NumericalError, match="not written: the parameter"):
        backend.save_state(tmp_path / "state")
    with pytest.raises(NumericalError, match="not written: the parameter"):
        backend.save_pretrained(tmp_path / "final")
    assert not (tmp_path / "state").exists() and not (tmp_path / "final").exists()


class Marked:
    """A trainer whose `save_state` writes numerics.json with `finite`, as the backend does."""

    def __init__(self, finite: bool):
        self.finite = finite

    def save_state(self, path):
        path.mkdir(parents=True)
        (path / "numerics.json").write_text(json.dumps({"finite": self.finite}))


def checkpoint(run_dir, step: int, finite: bool | None):
    path = save_checkpoint(run_dir, step, Marked(bool(finite)), {"step": step}, "seed: 0\n")
    if finite is None:  # a checkpoint from before the mark
        manifest = json.loads((path / "COMPLETE").read_text())
        del manifest["finite"]
        (path / "COMPLETE").write_text(json.dumps(manifest))
    return path


def test_pruning_keeps_the_newest_finite_checkpoint_while_newer_ones_are_suspect(tmp_path):
    old, good = checkpoint(tmp_path, 1, None), checkpoint(tmp_path, 2, True)
    assert is_finite(old) and is_finite(good)
    prune(tmp_path, keep_last=1, best_step=None)
    assert not old.exists()
    suspect = [checkpoint(tmp_path, step, False) for step in (3, 4)]
    prune(tmp_path, keep_last=1, best_step=None)
    assert good.exists() and not suspect[0].exists() and suspect[1].exists()
    # a resume goes back to the finite one, past the suspect one
    assert latest_checkpoint(tmp_path, warn=lambda line: None) == good
    newest = checkpoint(tmp_path, 5, True)
    prune(tmp_path, keep_last=1, best_step=None)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [newest.name]


def test_a_resume_with_only_suspect_checkpoints_takes_the_newest(tmp_path):
    checkpoint(tmp_path, 1, False)
    newest = checkpoint(tmp_path, 2, False)
    warnings = []
    assert latest_checkpoint(tmp_path, warn=warnings.append) == newest
    assert warnings[-1].startswith("no checkpoint marked finite")


def test_the_hf_engine_refuses_non_finite_logits_in_one_line():
    check_finite_logits(torch.tensor([[0.0, -INF, 1.0]]), 0)  # a masked token is not a fault
    for bad in ([[0.0, NAN, 1.0]], [[0.0, INF, 1.0]], [[-INF, -INF, -INF]]):
        with pytest.raises(NumericalError, match="logits are not finite at decoding step 3"):
            check_finite_logits(torch.tensor(bad), 3)
