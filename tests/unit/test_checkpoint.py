"""Checkpoints: exact trainer state round trip, atomic writes, corrupt ones skipped, refusal to resume
under a different config, pruning."""

from functools import partial

import pytest
import torch
from test_torch_backend import loss_fn, make_backend, make_batch

from reinforge.algorithms.losses import token_mean
from reinforge.errors import ConfigError
from reinforge.training.checkpoint import (check_compatible, latest_checkpoint, load_driver_state, prune, save_checkpoint)


def weights(backend):
    return {name: tensor.clone() for name, tensor in backend.model.state_dict().items()}


def test_a_restored_trainer_continues_exactly_like_the_uninterrupted_one(tiny_model_dir, tmp_path):
    batch = make_batch()
    uninterrupted = make_backend(tiny_model_dir, micro_batch_size=4)
    batch.old_logprobs = uninterrupted.logprobs(batch) + 0.1 * batch.loss_mask
    step = partial(loss_fn, token_mean, 0.0)
    uninterrupted.train_step(batch, step)
    save_checkpoint(tmp_path, 1, uninterrupted, {"step": 1}, "seed: 0\n")
    expected = [uninterrupted.train_step(batch, step) for _ in range(2)]

    resumed = make_backend(tiny_model_dir, micro_batch_size=4)  # fresh weights, empty AdamW moments
    path = latest_checkpoint(tmp_path)
    resumed.load_state(path / "trainer")
    assert load_driver_state(path) == {"step": 1}
    got = [resumed.train_step(batch, step) for _ in range(2)]
    assert got == expected  # bitwise: loss, grad_norm, lr
    for name, tensor in weights(uninterrupted).items():
        assert torch.equal(weights(resumed)[name], tensor), name


def test_a_crash_mid_save_leaves_the_previous_checkpoint_as_the_newest(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    save_checkpoint(tmp_path, 1, backend, {"step": 1}, "")

    class Crashing:
        def save_state(self, path):
            path.mkdir()
            (path / "state.pt").write_bytes(b"partial")
            raise KeyboardInterrupt  # the kill arrives mid-write

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, Crashing(), {"step": 2}, "")
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_an_incomplete_or_corrupt_checkpoint_is_skipped_with_a_warning(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, backend, {"step": step}, "")
    (tmp_path / "checkpoints" / "step_00000003" / "COMPLETE").unlink()  # never finished
    with open(tmp_path / "checkpoints" / "step_00000002" / "trainer" / "state.pt", "r+b") as handle:
        handle.truncate(100)  # a truncated copy
    warnings = []
    assert latest_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert len(warnings) == 2 and "step_00000003" in warnings[0] and "step_00000002" in warnings[1]


def test_resuming_under_a_different_model_or_batch_is_refused_naming_the_setting(tmp_path):
    saved = {"model": {"name_or_path": "models/demo"}, "training": {"lr": 1e-4}, "grpo": {"max_steps": 10}}
    check_compatible(saved, {**saved, "grpo": {"max_steps": 20}}, tmp_path)  # a longer run is fine
    with pytest.raises(ConfigError, match=r"model.name_or_path was 'models/demo' there and is 'Qwen/Qwen2.5-1.5B' now"):
        check_compatible(saved, {**saved, "model": {"name_or_path": "Qwen/Qwen2.5-1.5B"}}, tmp_path)
    with pytest.raises(ConfigError, match="training.lr"):
        check_compatible(saved, {**saved, "training": {"lr": 3e-4}}, tmp_path)


def test_pruning_keeps_the_newest_and_the_best(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, backend, {"step": step}, "")
    prune(tmp_path, keep_last=2, best_step=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]
