"""The training backend on FSDP2 ranks (`FSDP2Strategy`) with real torch.distributed (gloo) in real processes.

One world of 1 rank and one world of 2 ranks run the same script once (module fixture: spawning
processes is the expensive part); the tests compare what they wrote.
"""

import random
import socket
import time
from functools import partial

import _shards
import pytest
import torch
import torch.multiprocessing as mp
from test_torch_backend import loss_fn, make_backend, make_batch
from transformers import AutoModelForCausalLM

from reinforge.algorithms.losses import token_mean
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.numerics import local
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

NUM_STEPS = 2
# every test here on one xdist worker: the module fixture (three process worlds, ~35 s) then runs once, not on both
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def perturb(batch, logprobs, ref_logprobs):
    """Old and reference logprobs away from the policy's, so the clip and the KL term are active."""
    noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs = logprobs + noise * batch.loss_mask
    batch.ref_logprobs = ref_logprobs - noise * batch.loss_mask


def run_rank(rank, world_size, port, model_dir, out_dir, activation_checkpointing):
    """The script every rank runs: logprobs, NUM_STEPS train steps, gather the weights, export."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    worker = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=2, global_batch_size=8, activation_checkpointing=activation_checkpointing),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        strategy=FSDP2Strategy(rank, world_size, "127.0.0.1", port),
        load_reference=True,
    )
    batch = make_batch()
    # what this rank holds (before a forward: FSDP2 leaves the root's parameters whole after one) and receives
    held, seen = _shards.held(worker.model), _shards.watch_inputs(worker.model)
    logprobs = worker.logprobs(batch)
    routing = {"rows": _shards.micro_batch_rows(worker, batch), "inputs": _shards.inputs_record(seen)}
    perturb(batch, logprobs, worker.logprobs(batch, reference=True))
    metrics = [worker.train_step(batch, partial(loss_fn, token_mean, 0.1)) for _ in range(NUM_STEPS)]
    weights = dict(worker.named_weights())
    worker.save_pretrained(out_dir / "export")
    worker.save_state(str(out_dir / "sharded_state"))  # each rank writes its shards
    # a NaN loss on the last rank's micro-batch 1 only: every rank skips the step alike (training/numerics.py)
    shards = [local(p).detach().clone() for p in worker.trainable]
    skipped, note = worker.checked_step(
        batch, partial(nan_on_rank, world_size - 1, [], partial(loss_fn, token_mean, 0))
    )
    unchanged = all(torch.equal(before, local(p)) for before, p in zip(shards, worker.trainable))
    result = {"logprobs": logprobs, "metrics": metrics, "nonfinite": (skipped["nonfinite_steps"], note, unchanged)}
    result |= {"held": held, "routing": routing}
    if rank == 0:
        result["weights"] = weights
    torch.save(result, out_dir / f"rank{rank}.pt")
    worker.shutdown()


def nan_on_rank(rank, calls, loss_fn, logprobs, micro, norm):
    """`loss_fn`, NaN on rank `rank`'s second micro-batch."""
    loss, metrics = loss_fn(logprobs, micro, norm)
    calls.append(1)
    if torch.distributed.get_rank() == rank and len(calls) == 2:
        loss = loss * float("nan")
    return loss, metrics


def free_ports(count):
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago, drawn below the kernel's ephemeral
    range (and above Ray's worker ports, 10002-19999): a launch uses its ports over minutes, and a port the
    kernel hands out for outgoing connections (Ray's, vLLM's, the other xdist worker's) could be taken meanwhile."""
    ports, rng = [], random.Random()
    while len(ports) < count:
        port = rng.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def launch(world_size, model_dir, out_dir, *args, target=run_rank, timeout_s=120, num_ports=1):
    """Run `target(rank, world_size, port, model_dir, out_dir, *args)` in `world_size` fresh processes on a
    free port (a list of `num_ports` distinct ones when more than one); fail, not hang, as soon as one fails."""
    ports = free_ports(num_ports)
    port = ports[0] if num_ports == 1 else ports
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=target, args=(rank, world_size, port, model_dir, out_dir, *args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(process.is_alive() for process in processes):
        if any(process.exitcode not in (None, 0) for process in processes):
            break  # the others would wait on it until their collective timeout
        time.sleep(0.2)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    assert all(process.exitcode == 0 for process in processes), [process.exitcode for process in processes]
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """{world_size: (per-rank results, export directory)} for worlds of 1 and 2 ranks, and "2ac": two
    ranks with activation checkpointing."""
    result = {}
    for key, world_size, checkpointing in ((1, 1, False), (2, 2, False), ("2ac", 2, True)):
        out_dir = tmp_path_factory.mktemp(f"fsdp2_{key}")
        result[key] = launch(world_size, tiny_model_dir, out_dir, checkpointing), out_dir / "export"
    return result


def test_two_ranks_give_the_same_loss_and_weights_as_one_rank(runs, tiny_model_dir):
    (one,), _ = runs[1]
    two, _ = runs[2]
    assert one["metrics"][0]["clip_fraction"] > 0 and one["metrics"][0]["kl"] > 0
    for name in ("loss", "pg_loss", "kl", "clip_fraction", "entropy", "ratio_max", "ratio_min", "grad_norm"):
        for step in range(NUM_STEPS):
            for rank in range(2):
                assert abs(two[rank]["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (name, step, rank)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, weight in one["weights"].items():
        assert (weight - initial[name]).abs().max() > 0, f"{name} was not updated"
        torch.testing.assert_close(two[0]["weights"][name], weight, atol=1e-5, rtol=0)
    # and one FSDP2 rank is the single-process backend
    backend = make_backend(tiny_model_dir, micro_batch_size=2, load_reference=True)
    batch = make_batch()
    perturb(batch, backend.logprobs(batch), backend.logprobs(batch, reference=True))
    for step in range(NUM_STEPS):
        metrics = backend.train_step(batch, partial(loss_fn, token_mean, 0.1))
        assert abs(metrics["loss"] - one["metrics"][step]["loss"]) <= 1e-5
    for name, weight in backend.named_weights():
        torch.testing.assert_close(one["weights"][name], weight, atol=1e-5, rtol=0)


def test_each_rank_holds_its_shard_and_gets_its_rows(runs, tiny_model_dir):
    """FSDP2 shards dim 0 of every parameter over the ranks (the embedding's 64 rows as 32 + 32); the two ranks
    train different rows, together the batch (_shards.py)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for key, world_size in ((1, 1), (2, 2), ("2ac", 2)):
        ranks, _ = runs[key]
        grid = _shards.Layout(dp_shard=world_size)
        for rank, result in enumerate(ranks):
            expected = _shards.expected_held(shapes, grid, rank, head_dim=16)
            _shards.assert_held(result["held"], expected, f"{key} rank {rank}")
            assert result["held"]["model.embed_tokens.weight"][3] == (64 // world_size, 32)
        routing = [result["routing"] for result in ranks]
        _shards.assert_routing([r["rows"] for r in routing], [r["inputs"] for r in routing], grid, len(make_batch()))


def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(runs):
    for key in (1, 2):
        ranks, _ = runs[key]
        where = "micro-batch 1" + (" of rank 1" if key == 2 else "")
        for rank in ranks:
            skipped, note, unchanged = rank["nonfinite"]
            assert skipped == 1.0 and unchanged, (key, rank["nonfinite"])
            assert note.startswith(f"step {NUM_STEPS + 1}: the loss is non-finite ({where}); the optimizer step was")


def test_activation_checkpointing_changes_memory_not_results(runs):
    (one,), _ = runs[1]
    checkpointed, _ = runs["2ac"]
    for step in range(NUM_STEPS):
        for name in ("loss", "grad_norm", "entropy"):
            assert abs(checkpointed[0]["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (name, step)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(checkpointed[0]["weights"][name], weight, atol=1e-5, rtol=0)


def test_logprobs_are_identical_across_ranks_and_match_the_single_process_backend(runs, tiny_model_dir):
    (one,), _ = runs[1]
    two, _ = runs[2]
    assert torch.equal(two[0]["logprobs"], two[1]["logprobs"])
    expected = make_backend(tiny_model_dir, micro_batch_size=2).logprobs(make_batch())
    assert expected.abs().max() > 0
    for logprobs in (one["logprobs"], two[0]["logprobs"]):
        torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)


def test_export_from_shards_loads_with_from_pretrained(runs):
    two, export_dir = runs[2]
    model = AutoModelForCausalLM.from_pretrained(export_dir)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    loaded = model.state_dict()
    assert loaded.keys() == two[0]["weights"].keys()
    for name, weight in two[0]["weights"].items():
        assert torch.equal(loaded[name], weight), name


def test_a_sharded_checkpoint_converts_to_the_full_weights(runs):
    from reinforge.training.convert import policy_state_dict

    two, export_dir = runs[2]
    full = policy_state_dict(export_dir.parent / "sharded_state")
    for name, weight in two[0]["weights"].items():
        if name in full:
            assert torch.equal(full[name], weight), name
    assert set(two[0]["weights"]) - set(full) <= {"lm_head.weight"}  # tied to the embeddings
