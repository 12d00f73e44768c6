from functools import partial

import pytest
import torch

from reinforge.algorithms.losses import grpo_loss, sequence_mean, token_mean
from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.data.batch import Trajectory, collate
from reinforge.training.torch_backend import TorchBackend, token_logprobs


def make_batch(num_rows=8, seed=0):
    """Rows of different prompt and response lengths, right-padded by `collate`."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(num_rows):
        num_prompt, num_response = 3 + row % 3, 2 + (row * 5) % 7
        ids = torch.randint(2, 64, (num_prompt + num_response,), generator=gen).tolist()
        trajectories.append(Trajectory(ids[:num_prompt], ids[num_prompt:], [0.0] * num_response, False, 0.0, row // 2, "math"))
    advantages = torch.randn(num_rows, generator=gen).tolist()
    return collate(trajectories, advantages, pad_token_id=0)


def make_backend(model_dir, micro_batch_size, load_reference=False, activation_checkpointing=False):
    torch.manual_seed(0)
    return TorchBackend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=micro_batch_size, global_batch_size=8, lr=1e-3, activation_checkpointing=activation_checkpointing),
        temperature=0.7,
        num_optimizer_steps=10,
        load_reference=load_reference,
    )


def loss_fn(aggregate, kl_coef, logprobs, micro, norm):
    return grpo_loss(logprobs, micro.old_logprobs, micro.advantages, micro.loss_mask, norm, aggregate=aggregate,
                     eps_low=0.2, eps_high=0.28, kl_coef=kl_coef, ref_logprobs_BT=micro.ref_logprobs)


@pytest.mark.parametrize("aggregate", [token_mean, sequence_mean])
def test_micro_batches_give_the_same_gradient_as_one_big_batch(tiny_model_dir, aggregate):
    batch = make_batch()
    grads = []
    for micro_batch_size in (8, 2, 1):
        backend = make_backend(tiny_model_dir, micro_batch_size)
        noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
        batch.old_logprobs = backend.logprobs(batch) + noise * batch.loss_mask  # ratios away from 1: clipping is exercised
        batch.ref_logprobs = backend.logprobs(batch) - noise * batch.loss_mask
        backend.optimizer.zero_grad()
        metrics = backend.accumulate_gradients(batch, partial(loss_fn, aggregate, 0.1))
        assert metrics["clip_fraction"] > 0
        grads.append(torch.cat([p.grad.flatten() for p in backend.model.parameters()]))
    assert grads[0].abs().max() > 0
    for other in grads[1:]:
        assert (other - grads[0]).abs().max() <= 1e-6


def test_activation_checkpointing_gives_the_same_gradient(tiny_model_dir):
    batch = make_batch()
    grads = []
    for checkpointing in (False, True):
        backend = make_backend(tiny_model_dir, 4, activation_checkpointing=checkpointing)
        batch.old_logprobs = backend.logprobs(batch) + 0.1 * batch.loss_mask
        backend.optimizer.zero_grad()
        backend.accumulate_gradients(batch, partial(loss_fn, token_mean, 0.0))
        grads.append(torch.cat([p.grad.flatten() for p in backend.model.parameters()]))
    assert backend.model.is_gradient_checkpointing
    assert grads[0].abs().max() > 0
    assert (grads[1] - grads[0]).abs().max() <= 1e-6


def test_ratio_is_one_and_kl_zero_on_the_first_minibatch(tiny_model_dir):
    backend = make_backend(tiny_model_dir, micro_batch_size=4, load_reference=True)
    batch = make_batch()
    batch.old_logprobs = backend.logprobs(batch)
    batch.ref_logprobs = backend.logprobs(batch, reference=True)
    metrics = backend.train_step(batch, partial(loss_fn, token_mean, 0.1))
    assert abs(metrics["ratio_max"] - 1) < 1e-6 and abs(metrics["ratio_min"] - 1) < 1e-6
    assert abs(metrics["kl"]) < 1e-7 and metrics["clip_fraction"] == 0
    # the step moved the policy away from the (frozen) reference
    after = backend.logprobs(batch)
    assert (after - batch.ref_logprobs).abs().max() > 1e-4


def test_logprobs_are_zero_outside_the_response_and_match_a_manual_forward(tiny_model_dir):
    backend = make_backend(tiny_model_dir, micro_batch_size=3)
    batch = make_batch()
    logprobs = backend.logprobs(batch)
    assert torch.all(logprobs[batch.loss_mask == 0] == 0)
    row = 5
    length = int(batch.attention_mask[row].sum())
    ids = batch.input_ids[row : row + 1, :length]
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits
    manual = torch.log_softmax(logits[0, :-1] / 0.7, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    mask = batch.loss_mask[row, 1:length] > 0
    torch.testing.assert_close(logprobs[row, 1:length][mask], manual[mask], atol=1e-5, rtol=0)


def test_token_logprobs_aligns_each_token_with_the_logits_before_it():
    """vocab 2, logits at position 0 are [0, ln 3] -> p(token 1) = 3/4; position 1's logits predict token 2 (unused)."""
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))], [5.0, 5.0]]])
    logprobs = token_logprobs(logits, torch.tensor([[0, 1]]), temperature=1.0)
    torch.testing.assert_close(logprobs, torch.tensor([[0.0, torch.log(torch.tensor(0.75)).item()]]))
