"""The GRPO backends' micro-batches: packed, token-budgeted and chunked logprobs are the plain padded
computation, to 1e-5 (training/micro_batching.py).

The reference in every test is the computation as it was before packing: one right-padded sequence
per row, the model's full [B, T, V] logits, `token_logprobs` and `token_entropy` over them.
"""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from reinforge.algorithms.losses import clipped_policy_loss, token_mean
from reinforge.data.batch import Normalisers, Trajectory, collate
from reinforge.data.packing import dense_mask, row_layout, sequence_rows, shared_prompt_rows
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.micro_batching import (
    LAYOUTS,
    LayoutCache,
    Prompts,
    chunked_head,
    plan_micro_batches,
    select_micro_batch,
    split_to,
    token_entropy,
    token_logprobs,
)
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

TEMPERATURE = 0.7


def ragged_batch(num_rows=12, seed=0):
    """Prompts of 2-8 tokens and answers of 1-15, every third one multi-turn (an environment span in
    the middle of the answer is masked out of the loss), advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(num_rows):
        num_prompt = int(torch.randint(2, 9, (1,), generator=gen))
        num_response = int(torch.randint(1, 16, (1,), generator=gen))
        ids = torch.randint(2, 64, (num_prompt + num_response,), generator=gen).tolist()
        mask = None
        if row % 3 == 0 and num_response >= 5:
            mask = [1, 1, 0, 0] + [1] * (num_response - 4)  # tokens 2-3 of the answer came from the environment
        trajectories.append(
            Trajectory(
                ids[:num_prompt],
                ids[num_prompt:],
                [0.0] * num_response,
                False,
                0.0,
                row // 4,
                "math",
                response_mask=mask,
            )
        )
    batch = collate(trajectories, torch.randn(num_rows, generator=gen).tolist(), pad_token_id=0)
    noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=gen)
    return batch, noise


def make_backend(model_dir, **training):
    torch.manual_seed(0)
    config = TrainingConfig(global_batch_size=12, **{"micro_batch_size": 12, **training})
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        config,
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(TEMPERATURE),
        load_reference=False,
    )


def loss_fn(logprobs, micro, norm):
    return clipped_policy_loss(
        logprobs,
        micro.old_logprobs,
        micro.advantages,
        micro.loss_mask,
        norm,
        aggregate=token_mean,
        eps_low=0.2,
        eps_high=0.28,
    )


def reference(model_dir, batch):
    """Logprobs, loss, entropy and gradient of the whole batch in one padded forward with full logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logprobs = token_logprobs(logits, batch.input_ids, TEMPERATURE) * batch.loss_mask
    norm = Normalisers(num_tokens=batch.num_valid_tokens(), num_sequences=len(batch))
    loss, _ = loss_fn(logprobs, batch, norm)
    loss.backward()
    entropy = token_mean(token_entropy(logits.detach(), TEMPERATURE), batch.loss_mask, norm)
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logprobs.detach(), loss.item(), entropy.item(), gradient


def backend_gradient(backend, batch):
    backend.optimizer.zero_grad(set_to_none=True)
    metrics = backend.accumulate_gradients(batch, loss_fn)
    return metrics, torch.cat([p.grad.flatten() for p in backend.model.parameters()])


def with_reference(model_dir, batch, noise):
    """The batch with old logprobs away from the policy's (so the clip is exercised), and the reference."""
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    logprobs, _, _, _ = reference(model_dir, batch)
    batch.old_logprobs = logprobs + noise * batch.loss_mask
    return batch, reference(model_dir, batch)


def assert_matches_reference(backend, batch, expected):
    ref_logprobs, ref_loss, ref_entropy, ref_gradient = expected
    torch.testing.assert_close(backend.logprobs(batch), ref_logprobs, atol=1e-5, rtol=0)
    metrics, gradient = backend_gradient(backend, batch)
    assert metrics["clip_fraction"] > 0 and gradient.abs().max() > 0
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert metrics["entropy"] == pytest.approx(ref_entropy, abs=1e-5)
    torch.testing.assert_close(gradient, ref_gradient, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    return with_reference(tiny_model_dir, *ragged_batch())


def test_a_packed_layout_holds_several_sequences_per_row_with_restarting_positions():
    """Lengths [3, 5, 2, 4] into rows as wide as the longest (5): 5 | 4 | 3 + 2 (first-fit decreasing)."""
    input_ids = torch.arange(1, 21).view(4, 5)
    lengths = [3, 5, 2, 4]
    rows = sequence_rows(lengths, pack=True)
    assert rows == [[1], [3], [0, 2]]
    layout = row_layout(input_ids, lengths, rows, pad_token_id=0)
    assert layout.input_ids.tolist() == [[6, 7, 8, 9, 10], [16, 17, 18, 19, 0], [1, 2, 3, 11, 12]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert layout.token_index[:, 0].tolist() == [10, 0, 13, 5]
    assert layout.token_index[1, :5].tolist() == [0, 1, 2, 3, 4]
    assert (layout.num_real_tokens, layout.num_slots) == (14, 15)
    # each sequence attends causally to itself only; the padding (slot 9) to nothing
    causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in (5, 4, 3, 2)]
    expected = torch.block_diag(causal[0], causal[1], torch.zeros(1, 1, dtype=torch.bool), causal[2], causal[3])
    assert torch.equal(dense_mask(layout), expected)
    # given prompt lengths but no two equal prompts, nothing is shared: the same layout
    shared = row_layout(input_ids, lengths, rows, pad_token_id=0, prompt_lengths_B=[2, 2, 1, 3])
    assert torch.equal(shared.input_ids, layout.input_ids) and torch.equal(dense_mask(shared), expected)


@pytest.mark.parametrize(
    "packing, attention, checkpointing",
    [
        (True, "sdpa", False),
        (True, "eager", False),
        (True, "sdpa", True),
        (False, "sdpa", False),
        (False, "eager", True),
    ],
)
def test_packed_and_unpacked_micro_batches_give_the_reference_logprobs_loss_and_gradient(
    tiny_model_dir, expected, packing, attention, checkpointing
):
    """Activation checkpointing recomputes each layer in the backward pass, after the forward pass that
    chose segment attention for the packed layout has returned: the recompute must attend the same way."""
    batch, reference_results = expected
    backend = make_backend(
        tiny_model_dir, sequence_packing=packing, micro_batch_size=4, activation_checkpointing=checkpointing
    )
    backend.model.set_attn_implementation(attention)
    if packing:  # the test must see rows that hold more than one sequence
        assert any(len(rows) < 4 for rows in plan_micro_batches(batch.attention_mask.sum(1).tolist(), backend.config))
    assert_matches_reference(backend, batch, reference_results)


@pytest.mark.parametrize("micro_batch_tokens", [1, 20, 45, 10_000])
def test_token_budget_micro_batches_give_the_gradient_of_one_big_batch(tiny_model_dir, expected, micro_batch_tokens):
    """A budget of 1 puts every packed row alone; 10,000 puts all of them in one micro-batch."""
    batch, (_, ref_loss, _, ref_gradient) = expected
    backend = make_backend(tiny_model_dir, micro_batch_tokens=micro_batch_tokens)
    lengths = batch.attention_mask.sum(1).tolist()
    plan = plan_micro_batches(lengths, backend.config)
    assert sorted(i for rows in plan for row in rows for i in row) == list(range(len(batch)))
    for rows in plan:
        width = max(sum(lengths[i] for i in row) for row in rows)
        assert len(rows) * width <= micro_batch_tokens or len(rows) == 1
    assert len(plan) == {1: len(sequence_rows(lengths, pack=True)), 10_000: 1}.get(micro_batch_tokens, len(plan))
    metrics, gradient = backend_gradient(backend, batch)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5)
    torch.testing.assert_close(gradient, ref_gradient, atol=1e-5, rtol=0)


def test_chunked_logprobs_and_entropies_equal_the_unchunked_ones(tiny_model_dir):
    """Chunks of 1, 7 and 49 of 50 tokens against log_softmax over the whole [50, V] logits at once;
    gradients too (each chunk's logits are recomputed in the backward pass)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hidden_NH = torch.randn(50, model.config.hidden_size)
    targets_N = torch.randint(0, model.config.vocab_size, (50,))
    reference_hidden = hidden_NH.clone().requires_grad_(True)
    logp_NV = torch.log_softmax(model.lm_head(reference_hidden) / TEMPERATURE, dim=-1)
    expected_logprobs = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
    expected_entropy = -(logp_NV.exp() * logp_NV).sum(-1).detach()
    expected_logprobs.sum().backward()
    for chunk_tokens in (1, 7, 49):
        hidden = hidden_NH.clone().requires_grad_(True)
        logprobs, entropy = chunked_head(model.lm_head, hidden, targets_N, TEMPERATURE, chunk_tokens)
        torch.testing.assert_close(logprobs.detach(), expected_logprobs.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
        logprobs.sum().backward()
        torch.testing.assert_close(hidden.grad, reference_hidden.grad, atol=1e-5, rtol=0)


def test_a_micro_batch_with_nothing_to_train_gives_zero_gradients_not_an_error(tiny_model_dir):
    batch, _ = ragged_batch()
    batch.loss_mask[:4] = 0  # the first micro-batch of 4 has no trained token
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    backend.optimizer.zero_grad(set_to_none=True)
    first = batch.select([0, 1, 2, 3])
    backend.accumulate_gradients(first, loss_fn)  # normalised by 0 tokens: max(0, 1)
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in backend.model.parameters())


def test_ranks_split_their_micro_batches_to_the_same_count():
    """A plan of one micro-batch of 4 rows, where another rank has 3 micro-batches: split in halves, the
    first half again: rows 0 | 1 | 2 + 3. A single row of 3 sequences splits into 0 | 1 + 2."""
    plan = [[[0], [1], [2], [3]]]
    assert split_to(plan, 3) == [[[0]], [[1]], [[2], [3]]]
    assert split_to([[[0, 1, 2]]], 2) == [[[0]], [[1, 2]]]


@pytest.mark.parametrize(
    "override, message",
    [
        (["training.micro_batch_tokens=0"], r"training.micro_batch_tokens: .*greater than or equal to 1 \(got 0\)"),
        (["training.logprob_chunk_tokens=0"], r"training.logprob_chunk_tokens: .*greater than or equal to 1 \(got 0\)"),
    ],
)
def test_bad_micro_batching_settings_are_one_line_errors(override, message):
    from reinforge.algorithms.grpo_config import load_config
    from reinforge.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, override)
    assert "\n" not in str(error.value)


def fsdp2_rank(rank, port, model_dir, out_dir, micro_batch_tokens):
    """One of 2 FSDP2 ranks: logprobs and one train step on `ragged_batch` with a token budget."""
    from reinforge.training.fsdp2 import FSDP2Strategy

    torch.set_num_threads(1)
    training = TrainingConfig(global_batch_size=12, micro_batch_size=12, micro_batch_tokens=micro_batch_tokens)
    worker = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        training,
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(TEMPERATURE),
        strategy=FSDP2Strategy(rank, 2, "127.0.0.1", port),
        load_reference=False,
    )
    batch, noise = ragged_batch()
    logprobs = worker.logprobs(batch)
    batch.old_logprobs = logprobs + noise * batch.loss_mask
    metrics = worker.train_step(batch, loss_fn)
    torch.save(
        {"logprobs": logprobs, "metrics": metrics, "weights": dict(worker.named_weights())}, out_dir / f"rank{rank}.pt"
    )
    worker.shutdown()


def test_fsdp2_ranks_with_unequal_token_budget_plans_train_like_one_process(tiny_model_dir, tmp_path):
    """Budget 32: rank 0's six sequences and rank 1's six pack into different numbers of micro-batches,
    which the ranks even out (`split_to`); the step equals the single-process backend's."""
    batch, noise = ragged_batch()
    lengths = batch.attention_mask.sum(1).tolist()
    config = TrainingConfig(global_batch_size=12, micro_batch_tokens=32)
    assert len(plan_micro_batches(lengths[:6], config)) != len(plan_micro_batches(lengths[6:], config))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=fsdp2_rank, args=(rank, port, tiny_model_dir, tmp_path, 32)) for rank in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        if process.is_alive():
            process.kill()
    assert [process.exitcode for process in processes] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    logprobs = backend.logprobs(batch)
    batch.old_logprobs = logprobs + noise * batch.loss_mask
    metrics = backend.train_step(batch, loss_fn)
    for result in ranks:
        torch.testing.assert_close(result["logprobs"], logprobs, atol=1e-5, rtol=0)
        assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
        assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], abs=1e-5)
    for name, weight in backend.named_weights():
        torch.testing.assert_close(ranks[0]["weights"][name], weight, atol=1e-5, rtol=0)


def grouped_batch(seed=1):
    """GRPO-shaped: 3 prompts (6, 3 and 9 tokens) x 4 samples with answers of 1-12 tokens; one answer
    repeats another of its group, one is multi-turn (tokens 2-3 masked out), advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for group, num_prompt in enumerate((6, 3, 9)):
        prompt = torch.randint(2, 64, (num_prompt,), generator=gen).tolist()
        for sample in range(4):
            response = torch.randint(2, 64, (int(torch.randint(1, 13, (1,), generator=gen)),), generator=gen).tolist()
            if group == 0 and sample == 3:
                response = list(trajectories[-1].response_ids)
            mask = (
                [1, 1, 0, 0] + [1] * (len(response) - 4) if group == 2 and sample == 1 and len(response) >= 5 else None
            )
            trajectories.append(
                Trajectory(prompt, response, [0.0] * len(response), False, 0.0, group, "math", response_mask=mask)
            )
    batch = collate(trajectories, torch.randn(len(trajectories), generator=gen).tolist(), pad_token_id=0)
    return batch, 0.3 * torch.randn(batch.loss_mask.shape, generator=gen)


def test_a_shared_prompt_row_holds_the_prompt_once_and_keeps_each_answer_to_itself():
    """Prompt [5, 6] with answers [7, 8] and [9]: one row [5, 6, 7, 8, 9], positions 0 1 2 3 2; token 9
    sees the prompt and itself, not the other answer."""
    input_ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0]])
    layout = row_layout(input_ids, [4, 3], [[0, 1]], pad_token_id=0, prompt_lengths_B=[2, 2])
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert layout.token_index[0].tolist() == [0, 1, 2, 3] and layout.token_index[1, :3].tolist() == [0, 1, 4]
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert dense_mask(layout).int().tolist() == expected
    # as segments: the first sequence whole (4 queries, 4 keys); answer [9] (1 query, the prompt + itself)
    shapes = sorted(
        (int(b.query_valid[n].sum()), int(b.key_valid[n].sum()))
        for b in layout.segments
        for n in range(len(b.query_valid))
    )
    assert shapes == [(1, 3), (4, 4)]
    # different prompts are not shared: causal within each sequence, nothing across (a padded second row too)
    layout = row_layout(
        torch.tensor([[5, 6, 7], [5, 4, 9], [3, 3, 0]]),
        [3, 3, 2],
        [[0, 1], [2]],
        pad_token_id=0,
        prompt_lengths_B=[2, 2, 1],
    )
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]]
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    expected = torch.block_diag(
        causal, causal, torch.ones(2, 2, dtype=torch.bool).tril(), torch.zeros(4, 4, dtype=torch.bool)
    )
    assert torch.equal(dense_mask(layout), expected)


def test_the_planner_shares_a_prompt_among_as_many_samples_as_the_token_budget_allows():
    """4 samples of one prompt (10 tokens + answers of 5): one run of 30 tokens without a limit; at 20
    tokens, runs of two (10 + 5 + 5); at 12, less than one sample, each sample alone. Two prompts
    interleaved in the batch: each one's samples together."""
    rows, widths = shared_prompt_rows([15] * 4, [10] * 4, [0] * 4, max_run_tokens=None)
    assert rows == [[0, 1, 2, 3]] and widths == [30]
    rows, widths = shared_prompt_rows([15] * 4, [10] * 4, [0] * 4, max_run_tokens=20)
    assert sorted(rows) == [[0, 1], [2, 3]] and widths == [20, 20]
    rows, widths = shared_prompt_rows([15] * 4, [10] * 4, [0] * 4, max_run_tokens=12)
    assert sorted(rows) == [[0], [1], [2], [3]] and widths == [15] * 4
    rows, widths = shared_prompt_rows([15, 7, 15, 7], [10, 3, 10, 3], [0, 1, 0, 1], max_run_tokens=None)
    assert rows == [[0, 2], [1, 3]] and widths == [20, 11]


@pytest.mark.parametrize(
    "training, attention",
    [
        ({}, "sdpa"),
        ({}, "eager"),
        ({"micro_batch_tokens": 40}, "sdpa"),
        ({"micro_batch_size": 5}, "sdpa"),
        ({"activation_checkpointing": True}, "sdpa"),
        ({"activation_checkpointing": True}, "eager"),
        ({"activation_checkpointing": True, "compile": True}, "sdpa"),
    ],
)
def test_shared_prompts_give_the_reference_logprobs_loss_and_gradient(tiny_model_dir, training, attention):
    """Budgets that split a prompt's samples over rows and micro-batches too; eager attention takes the
    mask as additive scores."""
    batch, reference_results = with_reference(tiny_model_dir, *grouped_batch())
    backend = make_backend(tiny_model_dir, **{"micro_batch_size": 12, **training})
    backend.model.set_attn_implementation(attention)
    assert backend.model.config._attn_implementation == attention
    lengths = batch.attention_mask.sum(1).tolist()
    prompts = Prompts.of(batch, backend.config)
    plan = plan_micro_batches(lengths, backend.config, prompts)
    assert sorted(i for rows in plan for row in rows for i in row) == list(range(len(batch)))
    slots = 0
    for rows in plan:
        micro, local_rows, indices = select_micro_batch(batch, rows)
        layout = row_layout(
            micro.input_ids, [lengths[i] for i in indices], local_rows, 0, micro.prompt_lengths.tolist()
        )
        slots += layout.num_slots
    assert slots < sum(lengths)  # fewer positions computed than the sequences' tokens: prompts were shared
    assert_matches_reference(backend, batch, reference_results)


def test_the_passes_of_a_step_build_each_micro_batchs_layout_once(tiny_model_dir):
    """Old logprobs, a second logprob pass (the reference's, were one loaded) and the training pass read
    the same micro-batches: their layouts are built by the first pass only; the next step's batch gets
    its own, and the cache forgets the oldest layouts beyond its token budget."""
    batch, _ = grouped_batch(seed=7)  # a batch no other test lays out (the cache is the process's)
    backend = make_backend(tiny_model_dir, micro_batch_size=5)
    plan = plan_micro_batches(batch.attention_mask.sum(1).tolist(), backend.config, Prompts.of(batch, backend.config))
    built = LAYOUTS.num_built
    batch.old_logprobs = backend.logprobs(batch)
    backend.logprobs(batch)
    backend_gradient(backend, batch)
    assert len(plan) == 3 and LAYOUTS.num_built - built == len(plan)
    other, _ = grouped_batch(seed=8)
    backend.logprobs(other)
    assert LAYOUTS.num_built - built > len(plan)

    cache = LayoutCache(max_tokens=int(batch.attention_mask.sum()) // 2)  # less than the batch
    for rows in plan:
        micro, local_rows, _ = select_micro_batch(batch, rows)
        cache.get(micro.input_ids, micro.attention_mask.sum(1).tolist(), local_rows, None)
    assert 1 <= len(cache.layouts) < len(plan) and cache.num_tokens <= cache.max_tokens
    assert cache.num_tokens == sum(layout.num_real_tokens for layout in cache.layouts.values())
