from dataclasses import replace
from functools import partial

import pytest
import torch

from reinforge.algorithms.grpo import computed_part
from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.algorithms.losses import clipped_policy_loss, sequence_mean, token_mean
from reinforge.algorithms.policy_loss import RewardKLLossConfig, old_policy_logprobs, policy_loss_fn, split_old_logprobs
from reinforge.data.batch import Trajectory, collate
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.micro_batching import token_logprobs
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig


def make_batch(num_rows=8, seed=0):
    """Rows of different prompt and response lengths, right-padded by `collate`."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(num_rows):
        num_prompt, num_response = 3 + row % 3, 2 + (row * 5) % 7
        ids = torch.randint(2, 64, (num_prompt + num_response,), generator=gen).tolist()
        trajectories.append(
            Trajectory(ids[:num_prompt], ids[num_prompt:], [0.0] * num_response, False, 0.0, row // 2, "math")
        )
    advantages = torch.randn(num_rows, generator=gen).tolist()
    return collate(trajectories, advantages, pad_token_id=0)


def make_backend(model_dir, micro_batch_size, load_reference=False, **training):
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=micro_batch_size, global_batch_size=8, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(temperature=0.7),
        load_reference=load_reference,
    )


def make_loss_fn(config: GRPORunConfig):
    """GRPO's loss function, as its learner builds it."""
    return policy_loss_fn(config.loss, config.generation.max_new_tokens, config.off_policy)


def loss_fn(aggregate, kl_coef, logprobs, micro, norm):
    return clipped_policy_loss(
        logprobs,
        micro.old_logprobs,
        micro.advantages,
        micro.loss_mask,
        norm,
        aggregate=aggregate,
        eps_low=0.2,
        eps_high=0.28,
        kl_coef=kl_coef,
        ref_logprobs_BT=micro.ref_logprobs,
    )


@pytest.mark.parametrize("aggregate", [token_mean, sequence_mean])
def test_micro_batches_give_the_same_gradient_as_one_big_batch(tiny_model_dir, aggregate):
    batch = make_batch()
    grads = []
    for micro_batch_size in (8, 2, 1):
        backend = make_backend(tiny_model_dir, micro_batch_size)
        noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
        batch.old_logprobs = (
            backend.logprobs(batch) + noise * batch.loss_mask
        )  # ratios away from 1: clipping is exercised
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


@pytest.mark.parametrize("is_correction", ["none", "token_truncate", "sequence_mask"])
def test_old_logprobs_from_the_training_pass_give_the_step_of_a_separate_pass(tiny_model_dir, is_correction):
    """loss.old_logprobs=auto with one optimizer step per rollout: logp_old is the training pass's own
    logprobs, detached. The update, the loss, the importance weights and the mismatch metrics must be
    those of the separate no-grad pass it replaces."""
    config = GRPORunConfig(
        loss=RewardKLLossConfig(
            is_correction=is_correction, clip_eps_high=0.28, is_sequence_low=0.9, is_sequence_high=1.1
        )
    )
    batch = make_batch()
    noise = 0.2 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2))
    batch.gen_logprobs = (
        make_backend(tiny_model_dir, 4).logprobs(batch) + noise
    ) * batch.loss_mask  # an engine that disagrees
    runs = []
    for separate_pass in (True, False):
        backend = make_backend(tiny_model_dir, micro_batch_size=3)
        batch.old_logprobs = backend.logprobs(batch) if separate_pass else None
        metrics = backend.accumulate_gradients(batch, make_loss_fn(config))
        runs.append((metrics, torch.cat([p.grad.flatten() for p in backend.model.parameters()])))
    (separate, separate_grad), (shared, shared_grad) = runs
    assert separate_grad.abs().max() > 1e-3
    assert (shared_grad - separate_grad).abs().max() <= 1e-6
    assert separate["token_mult_prob_error"] > 1.05 and separate["is_ratio_min"] < 0.9  # the mismatch is seen
    for name in (
        "loss",
        "pg_loss",
        "ratio_mean",
        "token_mult_prob_error",
        "gen_kl_error",
        "is_ratio_mean",
        "is_ratio_min",
        "is_ratio_max",
    ):
        assert shared[name] == pytest.approx(separate[name], rel=1e-5, abs=1e-7), name


def test_several_global_batches_take_old_logprobs_only_for_the_later_ones(tiny_model_dir):
    """loss.old_logprobs=auto with two optimizer steps per rollout: the first global batch's logp_old is its
    training pass's own, only the second's comes from a pass before the first update, and both steps, their
    ratios and the weights after them are those of a pass over every row (`recompute`)."""
    config = GRPORunConfig(loss=RewardKLLossConfig(clip_eps_high=0.28))
    batch = make_batch()
    runs = []
    for whole in (True, False):
        backend = make_backend(tiny_model_dir, micro_batch_size=2)
        part = replace(batch, old_logprobs=None)
        first_row = old_policy_logprobs(backend, part, 4, whole)
        parts = split_old_logprobs(part, 4, first_row)
        assert first_row == (0 if whole else 4)
        metrics = [backend.train_step(global_batch, make_loss_fn(config)) for global_batch in parts]
        runs.append((part, parts, metrics, dict(backend.named_weights())))
    (whole, whole_parts, whole_metrics, whole_weights), (split, split_parts, split_metrics, split_weights) = runs
    assert split_parts[0].old_logprobs is None and (split.old_logprobs[:4] == 0).all()
    assert (split_parts[1].old_logprobs - whole_parts[1].old_logprobs).abs().max() <= 1e-6
    assert abs(split_metrics[1]["ratio_max"] - 1) > 1e-4  # the second step's ratio is against the old policy
    for split_step, whole_step in zip(split_metrics, whole_metrics):
        for name in ("loss", "ratio_max", "ratio_min", "grad_norm"):
            assert split_step[name] == pytest.approx(whole_step[name], rel=1e-5, abs=1e-7), name
    assert max((split_weights[name] - whole_weights[name]).abs().max() for name in whole_weights) <= 1e-6
    assert old_policy_logprobs(backend, replace(batch, old_logprobs=None), 8, False) is None  # one step: no pass


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_leaving_out_zero_advantage_sequences_gives_the_same_update(tiny_model_dir, aggregation):
    """grpo.skip_zero_advantage: the sequences of groups whose rewards were all equal are not run, the loss
    still divides by the whole batch's counts, so the step equals the whole batch's; metric means are over
    the sequences run."""
    config = GRPORunConfig(loss=RewardKLLossConfig(clip_eps_high=0.28, aggregation=aggregation))
    batch = make_batch()
    batch.advantages[[1, 2, 5]] = 0.0
    part = computed_part(batch, config)
    assert len(part) == 5 and part.normalisers().num_tokens == batch.num_valid_tokens()
    assert (
        computed_part(batch, GRPORunConfig(loss=RewardKLLossConfig(kl_coef=0.1))) is batch
    )  # a KL term: every sequence has a loss
    overlong_filtered = replace(batch, loss_mask=batch.loss_mask.clone())
    overlong_filtered.loss_mask[7] = 0.0  # nothing to train on: left out too
    assert len(computed_part(overlong_filtered, config)) == 4
    nothing = replace(
        batch, advantages=torch.zeros_like(batch.advantages)
    )  # the step still runs, on the shortest sequence per rank
    assert len(computed_part(nothing, config)) == 1
    two_ranks = GRPORunConfig(training=TrainingConfig(backend="fsdp2", num_workers=2))
    assert len(computed_part(nothing, two_ranks)) == 2
    assert len(computed_part(batch, two_ranks)) == 6  # 5 sequences to train on, topped up to equal shares
    runs = []
    shift_BT = 0.05 * torch.arange(len(batch)).unsqueeze(1) * batch.loss_mask  # ratios differ by row, some clipped
    batch.old_logprobs = make_backend(tiny_model_dir, 4).logprobs(batch) + shift_BT
    part = computed_part(batch, config)
    for train_on in (
        batch,
        part,
        batch.select([0, 3, 4, 6, 7]),
    ):  # the last: the same sequences as a batch of their own
        backend = make_backend(tiny_model_dir, micro_batch_size=3)
        metrics = backend.accumulate_gradients(train_on, make_loss_fn(config))
        runs.append((metrics, torch.cat([p.grad.flatten() for p in backend.model.parameters()])))
    (whole, whole_grad), (skipped, skipped_grad), (alone, alone_grad) = runs
    assert whole_grad.abs().max() > 1e-3
    assert (skipped_grad - whole_grad).abs().max() <= 1e-6
    assert (alone_grad - whole_grad).abs().max() > 1e-3  # dividing by the part's own counts would differ
    assert skipped["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    for name in ("ratio_mean", "clip_fraction", "entropy"):  # metric means: over the sequences run
        assert skipped[name] == pytest.approx(alone[name], rel=1e-5), name
    assert skipped["ratio_mean"] != pytest.approx(whole["ratio_mean"], rel=1e-3)


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


def test_compiled_decoder_layers_give_the_same_logprobs_and_gradient(tiny_model_dir):
    """training.compile=true: Inductor's fused layers compute what the eager layers compute."""
    batch = make_batch()
    results = []
    torch._dynamo.utils.counters.clear()  # the graph count below is this test's, not an earlier one's
    for compile_layers in (False, True):
        backend = make_backend(tiny_model_dir, 4, compile=compile_layers)
        logprobs = backend.logprobs(batch)
        batch.old_logprobs = logprobs + 0.1 * batch.loss_mask
        backend.optimizer.zero_grad()
        backend.accumulate_gradients(batch, partial(loss_fn, token_mean, 0.0))
        results.append((logprobs, torch.cat([p.grad.flatten() for p in backend.model.parameters()])))
    assert all(layer._compiled_call_impl is not None for layer in backend.model.model.layers)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # Dynamo captured graphs, not only fell back
    assert results[0][1].abs().max() > 0
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=0)
