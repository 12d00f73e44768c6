"""The Tinker trainer (reinforge/tinker/training.py) on the demo model: its outputs are the policy's logprobs at any
targets, optim_step is torch's AdamW with the request's parameters on the gradient of the loss, gradients add up over
forward_backward calls until optim_step, LoRA clients get the rank they ask for; and 2 FSDP2 ranks train as 1."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fsdp2_worker import launch

from reinforge.cluster import worker_group
from reinforge.cluster.config import TrainerClusterConfig
from reinforge.data.batch import sequences_batch
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.tinker.datum import Datum
from reinforge.tinker.errors import TinkerRequestError
from reinforge.tinker.training import AdamStep, TinkerTrainer, build_tinker_backend
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

DEMO = str(Path(__file__).resolve().parents[2] / "models" / "demo")
TRAINING = TrainingConfig(micro_batch_size=2)
SEQUENCES = [[5, 17, 30, 31, 40, 9], [7, 8, 100, 3], [11, 12, 13, 14, 15, 16, 17, 18]]


def next_token_datums(weights=None) -> list[Datum]:
    """Each sequence as Tinker's SFT datum: tokens[:-1] predict tokens[1:], the first target weightless."""
    return [
        Datum(s[:-1], {"target_tokens": np.array(s[1:]), "weights": np.array([0.0] + [1.0] * (len(s) - 2))})
        for s in SEQUENCES
    ]


@pytest.fixture(scope="module")
def trainer():
    trainer, stop = build_tinker_backend(ModelConfig(name_or_path=DEMO), TRAINING, None, None)
    yield trainer
    stop()


def by_hand_logprobs(model, tokens, targets) -> torch.Tensor:
    """log_softmax of the model's logits on the tokens alone, at the targets."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets)[:, None])[:, 0]


def test_forward_gives_the_backends_logprobs_of_the_next_tokens(trainer):
    result = trainer.forward_backward(next_token_datums(), "cross_entropy", {}, backward=False)
    batch = sequences_batch([(s, [0.0] + [1.0] * (len(s) - 1)) for s in SEQUENCES], pad_token_id=0)
    logprobs_BT = trainer.backend.logprobs(batch)
    for row, (sequence, output) in enumerate(zip(SEQUENCES, result.outputs)):
        np.testing.assert_allclose(output["logprobs"], logprobs_BT[row, 1 : len(sequence)].numpy(), atol=1e-5)
    expected = -sum(float(logprobs_BT[row, 2 : len(s)].sum()) for row, s in enumerate(SEQUENCES))
    assert result.metrics == pytest.approx({"loss:sum": expected}, abs=1e-4)


def test_forward_at_arbitrary_targets_and_with_k_targets_per_position(trainer):
    targets = [[0, 0, 3, 99, 1], [2, 0, 5], [63, 62, 61, 0, 0, 0, 7]]
    datums = [
        Datum(s[:-1], {"target_tokens": np.array(t), "weights": np.ones(len(t))}) for s, t in zip(SEQUENCES, targets)
    ]
    wide = Datum(SEQUENCES[1][:-1], {"target_tokens": np.array([[2, 4], [0, 9], [5, 5]]), "weights": np.ones((3, 2))})
    result = trainer.forward_backward([*datums, wide], "cross_entropy", {}, backward=False)
    model = trainer.backend.model
    for datum, output in zip(datums, result.outputs):
        expected = by_hand_logprobs(model, datum.tokens, datum.inputs["target_tokens"])
        np.testing.assert_allclose(output["logprobs"], expected.numpy(), atol=1e-5)
    with torch.no_grad():
        logits = model(torch.tensor([wide.tokens])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor([[2, 4], [0, 9], [5, 5]]))
    np.testing.assert_allclose(result.outputs[-1]["logprobs"], expected.numpy(), atol=1e-5)


def test_a_token_outside_the_vocabulary_is_a_request_error(trainer):
    bad = Datum([1, 2], {"target_tokens": np.array([3, 10**6]), "weights": np.ones(2)})
    with pytest.raises(TinkerRequestError, match="datum 0: target_tokens holds token id 1000000, outside"):
        trainer.forward_backward([bad], "cross_entropy", {}, backward=True)


def named(name: str):
    """assert_close's message, with the parameter's name."""
    return lambda message: f"{name}: {message}"


def adamw_by_hand(model, datums, adam: AdamStep, steps: int) -> None:
    """`steps` AdamW steps (torch's formulas, decoupled weight decay, clipping by the global norm) on the summed
    cross-entropy of the datums, computed on the plain model, one datum at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(1, steps + 1):
        model.zero_grad()
        for datum in datums:
            logits = model(torch.tensor([datum.tokens])).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(datum.inputs["target_tokens"])[:, None])[:, 0]
            (-(lp * torch.tensor(datum.inputs["weights"], dtype=torch.float32)).sum()).backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
        scale = min(1.0, adam.grad_clip_norm / (float(norm) + 1e-6)) if adam.grad_clip_norm > 0 else 1.0
        with torch.no_grad():
            for p, (m, v) in zip(params, moments):
                g = p.grad * scale
                m.mul_(adam.beta1).add_((1 - adam.beta1) * g)
                v.mul_(adam.beta2).add_((1 - adam.beta2) * g * g)
                p.mul_(1 - adam.learning_rate * adam.weight_decay)
                m_hat, v_hat = m / (1 - adam.beta1**step), v / (1 - adam.beta2**step)
                p.sub_(adam.learning_rate * m_hat / (v_hat.sqrt() + adam.eps))


def test_optim_step_is_adamw_with_the_requests_parameters():
    trainer, stop = build_tinker_backend(ModelConfig(name_or_path=DEMO), TRAINING, None, None)
    reference = copy.deepcopy(trainer.backend.model)
    # eps well above float32's noise in the gradients that are zero in exact arithmetic (the key projections' biases,
    # which shift every attention score alike): Adam's first step moves a weight by lr * g / (|g| + eps), the sign
    # of the noise at a smaller eps
    adam = AdamStep(learning_rate=1e-3, beta1=0.8, beta2=0.9, eps=1e-2, weight_decay=0.1, grad_clip_norm=5.0)
    for _ in range(2):
        trainer.forward_backward(next_token_datums(), "cross_entropy", {}, backward=True)
        metrics = trainer.optim_step(adam)
    assert metrics["optim/grad_norm"] > 5.0 and metrics["optim/lr"] == 1e-3  # the clipping was active
    adamw_by_hand(reference, next_token_datums(), adam, steps=2)
    trained = dict(trainer.backend.model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(
            trained[name], param, atol=1e-6, rtol=0, msg=lambda message, name=name: f"{name}: {message}"
        )
    stop()


def test_two_forward_backward_calls_then_one_step_train_on_their_sum():
    datums, adam = next_token_datums(), AdamStep(learning_rate=1e-3, eps=1e-2)  # eps: as above
    split, stop_split = build_tinker_backend(ModelConfig(name_or_path=DEMO), TRAINING, None, None)
    first = split.forward_backward(datums[:1], "cross_entropy", {}, backward=True)
    second = split.forward_backward(datums[1:], "cross_entropy", {}, backward=True)
    split.optim_step(adam)
    whole, stop_whole = build_tinker_backend(ModelConfig(name_or_path=DEMO), TRAINING, None, None)
    both = whole.forward_backward(datums, "cross_entropy", {}, backward=True)
    whole.optim_step(adam)
    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(both.metrics["loss:sum"], abs=1e-4)
    initial = dict(copy.deepcopy(whole.backend.model).named_parameters())
    for (name, a), (_, b) in zip(split.backend.model.named_parameters(), whole.backend.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=named(name))
    assert any((initial[name] - p).abs().max() > 0 for name, p in split.backend.model.named_parameters())
    stop_split()
    stop_whole()


def test_a_client_side_custom_loss_trains_through_the_cross_entropy_surrogate(trainer):
    """The SDK's forward_backward_custom: a forward with cross_entropy (weights 0), the loss C(lp) and its gradient
    on the client, then cross_entropy with weights -dC/dlp: the parameters' gradient is C's (here sum(lp^2))."""
    datums = next_token_datums()
    for datum in datums:
        datum.inputs["weights"] = np.zeros(len(datum.tokens))
    forward = trainer.forward_backward(datums, "cross_entropy", {}, backward=False)
    for datum, output in zip(datums, forward.outputs):
        datum.inputs["weights"] = -2.0 * output["logprobs"]  # -d(lp^2)/dlp
    model = trainer.backend.model
    model.zero_grad()
    trainer.forward_backward(datums, "cross_entropy", {}, backward=True)
    surrogate = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for datum in datums:
        logits = model(torch.tensor([datum.tokens])).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(datum.inputs["target_tokens"])[:, None])
        (lp**2).sum().backward()
    for name, param in model.named_parameters():
        # float32 over different micro-batchings: a wrong surrogate is off by the gradient itself
        torch.testing.assert_close(surrogate[name], param.grad, atol=5e-4, rtol=1e-3, msg=named(name))
    model.zero_grad()


def adapters(trainer: TinkerTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters() if p.requires_grad}


def test_a_lora_client_gets_its_rank_and_its_seed():
    model = ModelConfig(name_or_path=DEMO, lora=LoraConfig(rank=16, alpha=8.0))
    four, stop_four = build_tinker_backend(model, TRAINING, None, lora_rank=4, seed=1)
    again, stop_again = build_tinker_backend(model, TRAINING, None, lora_rank=4, seed=1)
    other, stop_other = build_tinker_backend(model, TRAINING, None, lora_rank=4, seed=2)
    a, b, c = adapters(four), adapters(again), adapters(other)
    assert a and all("lora_" in name for name in a)
    assert all(p.shape[0] == 4 for name, p in a.items() if "lora_A" in name)
    assert all(p.shape[1] == 4 for name, p in a.items() if "lora_B" in name)
    assert four.backend.lora.alpha == 8.0 and four.backend.lora.rank == 4
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert any(not torch.equal(a[name], c[name]) for name in a if "lora_A" in name)
    four.forward_backward(next_token_datums(), "cross_entropy", {}, backward=True)
    four.optim_step(AdamStep(learning_rate=1e-2))
    assert any(not torch.equal(a[name], p) for name, p in adapters(four).items())
    for stop in (stop_four, stop_again, stop_other):
        stop()


def tiny_backend(model_dir, **kwargs) -> Backend:
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        optimizer=OptimizerConfig(),
        scheduler=SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(1.0),
        **kwargs,
    )


def one_step(backend: Backend) -> dict:
    """One forward_backward of three datums (padded to four rows on two ranks), one optim_step, one forward."""
    trainer = TinkerTrainer(backend)
    datums = [
        Datum([t % 64 for t in s[:-1]], {"target_tokens": np.array(s[1:]) % 64, "weights": np.ones(len(s) - 1)})
        for s in SEQUENCES
    ]
    result = trainer.forward_backward(datums, "cross_entropy", {}, backward=True)
    metrics = trainer.optim_step(AdamStep(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0))
    after = trainer.forward_backward(datums, "cross_entropy", {}, backward=False)
    results = {  # tensors: a rank's file is read with torch.load's weights_only
        key: ([torch.from_numpy(out["logprobs"]) for out in r.outputs], r.metrics)
        for key, r in (("result", result), ("after", after))
    }
    return {**results, "metrics": metrics, "weights": dict(backend.named_weights())}


def run_tinker_rank(rank, world_size, port, model_dir, out_dir):
    torch.set_num_threads(1)
    strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
    backend = tiny_backend(
        model_dir, training=TrainingConfig(backend="fsdp2", num_workers=2, micro_batch_size=1), strategy=strategy
    )
    torch.save(one_step(backend), out_dir / f"rank{rank}.pt")
    backend.shutdown()


@pytest.mark.xdist_group("ray")
def test_a_lora_client_on_fsdp2_ranks_in_ray_trains_as_in_process():
    """`training.backend=fsdp2`: two ranks in Ray actors (cluster/fsdp2_trainer.py's `FSDP2Ranks`) give the outputs,
    the loss and the step of the trainer in this process, with the same LoRA adapters from the same seed."""
    datums, adam = next_token_datums(), AdamStep(learning_rate=1e-2, eps=1e-2)
    results, cluster = {}, TrainerClusterConfig(num_cpus=2)
    stop_ray = worker_group.ensure_ray(cluster, 2)  # build_tinker_backend's own call finds it running
    for kind, training in (
        ("torch", TRAINING),
        ("fsdp2", TrainingConfig(backend="fsdp2", num_workers=2, micro_batch_size=1, device="cpu")),
    ):
        model = ModelConfig(name_or_path=DEMO, lora=LoraConfig(rank=8))
        trainer, stop = build_tinker_backend(model, training, cluster, lora_rank=4, seed=3)
        try:
            first = trainer.forward_backward(datums, "cross_entropy", {}, backward=True)
            step = trainer.optim_step(adam)
            after = trainer.forward_backward(datums, "cross_entropy", {}, backward=False)
        finally:
            stop()
        results[kind] = first, step, after
    stop_ray()
    (first, step, after), (ray_first, ray_step, ray_after) = results["torch"], results["fsdp2"]
    assert ray_step["optim/grad_norm"] == pytest.approx(step["optim/grad_norm"], rel=1e-5)
    for mine, theirs in ((first, ray_first), (after, ray_after)):
        assert theirs.metrics["loss:sum"] == pytest.approx(mine.metrics["loss:sum"], abs=1e-3)
        for a, b in zip(theirs.outputs, mine.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4)
    assert after.metrics["loss:sum"] < first.metrics["loss:sum"]


@pytest.mark.xdist_group("fsdp2_worker")
def test_two_fsdp2_ranks_train_as_one_process(tiny_model_dir, tmp_path):
    one = one_step(tiny_backend(tiny_model_dir, training=TrainingConfig(micro_batch_size=1)))
    for rank in launch(2, tiny_model_dir, tmp_path, target=run_tinker_rank):
        for key in ("result", "after"):
            assert rank[key][1]["loss:sum"] == pytest.approx(one[key][1]["loss:sum"], abs=1e-4)
            for a, b in zip(rank[key][0], one[key][0], strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert rank["metrics"]["optim/grad_norm"] == pytest.approx(one["metrics"]["optim/grad_norm"], abs=1e-4)
        for name, weight in one["weights"].items():
            torch.testing.assert_close(rank["weights"][name], weight, atol=1e-5, rtol=0, msg=named(name))
    assert one["after"][1]["loss:sum"] < one["result"][1]["loss:sum"]
