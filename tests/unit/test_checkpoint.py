"""Checkpoints: exact trainer state round trip, atomic writes, corrupt ones skipped, refusal to resume
under a different config, pruning."""

import hashlib
import json
import multiprocessing
import os
import random
import signal
import time
from functools import partial

import pytest
import torch
from test_torch_backend import loss_fn, make_backend, make_batch

from reinforge.algorithms.losses import token_mean
from reinforge.errors import ConfigError
from reinforge.training.checkpoint import (
    check_compatible,
    is_complete,
    latest_checkpoint,
    load_driver_state,
    prune,
    save_checkpoint,
    verifies,
)


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
    with open(tmp_path / "checkpoints" / "step_00000002" / "trainer" / "__0_0.distcp", "r+b") as handle:
        handle.truncate(100)  # a truncated copy
    warnings = []
    assert latest_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert len(warnings) == 2 and "step_00000003" in warnings[0] and "step_00000002" in warnings[1]


def test_resuming_under_a_different_model_or_batch_is_refused_naming_the_setting(tmp_path):
    saved = {"model": {"name_or_path": "models/demo"}, "optimizer": {"lr": 1e-4}, "loop": {"max_steps": 10}}
    check_compatible(saved, {**saved, "loop": {"max_steps": 20}}, tmp_path)  # a longer run is fine
    with pytest.raises(ConfigError, match=r"model.name_or_path was 'models/demo' there and is 'Qwen/Qwen2.5-1.5B' now"):
        check_compatible(saved, {**saved, "model": {"name_or_path": "Qwen/Qwen2.5-1.5B"}}, tmp_path)
    with pytest.raises(ConfigError, match=r"optimizer.lr was 0.0001 there and is 0.0003 now"):
        check_compatible(saved, {**saved, "optimizer": {"lr": 3e-4}}, tmp_path)


def test_pruning_keeps_the_newest_and_the_best(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, backend, {"step": step}, "")
    prune(tmp_path, keep_last=2, best_step=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]


def test_a_checkpoint_whose_content_was_corrupted_keeps_its_sizes_but_fails_its_checksums(tiny_model_dir, tmp_path):
    """COMPLETE records each file's size and SHA-256: bytes flipped in the newest checkpoint's weights (same size)
    make it fail verification, so the newest that verifies is the one before, with a warning naming the corrupt one.
    A checkpoint written before checksums (sizes only) still counts."""
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, backend, {"step": step}, "")
    newest = tmp_path / "checkpoints" / "step_00000002"
    manifest = json.loads((newest / "COMPLETE").read_text())["files"]
    assert (
        manifest["trainer/__0_0.distcp"]["sha256"]
        == hashlib.sha256((newest / "trainer" / "__0_0.distcp").read_bytes()).hexdigest()
    )
    with open(newest / "trainer" / "__0_0.distcp", "r+b") as handle:
        handle.seek(2000)
        chunk = handle.read(64)
        handle.seek(2000)
        handle.write(bytes(b ^ 0xFF for b in chunk))
    assert is_complete(newest) and not verifies(newest)
    warnings = []
    assert latest_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert warnings == [f"checkpoint {newest} does not match its COMPLETE manifest's checksums (corrupt); skipping it"]

    older = tmp_path / "checkpoints" / "step_00000001"
    sizes_only = {
        "step": 1,
        "files": {name: entry["size"] for name, entry in json.loads((older / "COMPLETE").read_text())["files"].items()},
    }
    (older / "COMPLETE").write_text(json.dumps(sizes_only))
    assert verifies(older)


def saving_forever(backend, run_dir, start_step: int) -> None:
    """A training loop's checkpointing with nothing else: save step after step, keeping the newest 2."""
    step = start_step
    while True:
        step += 1
        save_checkpoint(run_dir, step, backend, {"step": step}, "")
        prune(run_dir, keep_last=2, best_step=None)


def test_saves_killed_at_20_random_moments_never_leave_a_checkpoint_that_verifies_but_does_not_load(
    tiny_model_dir, tmp_path
):
    """A forked child saves checkpoints back to back (each save, then pruning to 2) and is SIGKILLed 20 times at
    moments spread uniformly over a save's duration (measured first), a fresh child each time starting after
    the newest step. After every kill: some checkpoint verifies; the newest that does loads (weights, AdamW
    state, driver state) and is never older than the newest before the kill, so no kill lost a checkpoint."""
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    start = time.perf_counter()
    save_checkpoint(tmp_path, 1, backend, {"step": 1}, "")
    save_s = time.perf_counter() - start
    context = multiprocessing.get_context("fork")
    rng = random.Random(0)
    newest_step, kills = 1, 0
    for index in range(20):
        child = context.Process(target=saving_forever, args=(backend, tmp_path, newest_step), daemon=True)
        child.start()
        time.sleep(rng.uniform(0.0, 2.0 * save_s) + 0.05 * (index % 2))
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        kills += child.exitcode == -signal.SIGKILL
        newest = latest_checkpoint(tmp_path, warn=lambda message: None)
        assert newest is not None and verifies(newest)
        restored = make_backend(tiny_model_dir, micro_batch_size=4)
        restored.load_state(newest / "trainer")
        step = load_driver_state(newest)["step"]
        assert step == int(newest.name.split("_")[1]) >= newest_step
        newest_step = step
    assert kills == 20 and newest_step > 1  # every child was killed, and saves went on between the kills
