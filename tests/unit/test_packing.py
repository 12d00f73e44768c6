"""Sequence packing: rows, micro-batches, and packed attention equal to one sequence per row."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforge.algorithms.sft import nll_loss
from reinforge.data.batch import Normalisers
from reinforge.data.chat import ChatExample, render_chat
from reinforge.data.packing import collate_examples, dense_mask, first_fit_decreasing, group_rows, micro_batches
from reinforge.modeling import enable_activation_checkpointing
from reinforge.paths import PROJECT_ROOT

DEMO = PROJECT_ROOT / "models" / "demo"


def test_first_fit_decreasing_puts_each_example_in_the_first_row_with_room():
    """Lengths [5, 3, 4, 2, 6], rows of 8. Longest first: 6 -> row 0 (2 left); 5 -> row 1 (3 left);
    4 -> row 2 (4 left); 3 -> row 1 (0 left); 2 -> row 0 (0 left)."""
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]


def test_rows_are_grouped_so_that_rows_times_the_longest_fit_the_token_budget():
    """Row lengths [8, 3, 8, 4], budget 16: 8 and 8 fill 2 x 8 = 16; then 4 and 3 make 2 x 4 = 8."""
    assert group_rows([8, 3, 8, 4], 16) == [[0, 2], [3, 1]]


def test_positions_restart_for_every_example_and_padding_is_never_trained():
    a = ChatExample(token_ids=[11, 12, 13], loss_mask=[0, 1, 1])
    b = ChatExample(token_ids=[21, 22], loss_mask=[0, 1])
    c = ChatExample(token_ids=[31, 32, 33, 34], loss_mask=[0, 0, 1, 1])
    batch = collate_examples([a, b, c], [[0, 1], [2]], pad_token_id=0, pack=True)
    layout = batch.layout
    assert layout.input_ids.tolist() == [[11, 12, 13, 21, 22], [31, 32, 33, 34, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]]
    assert (layout.num_real_tokens, batch.num_trained_tokens, layout.num_slots) == (9, 5, 10)
    causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in (3, 2, 4)]
    assert torch.equal(dense_mask(layout), torch.block_diag(*causal, torch.zeros(1, 1, dtype=torch.bool)))
    padded = collate_examples([a, b, c], [[0], [1], [2]], pad_token_id=0, pack=False)
    assert padded.layout.input_ids.tolist() == [[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]]
    assert padded.loss_mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]] and padded.layout.segments is None


def test_micro_batches_hold_every_example_once_within_the_token_budget():
    examples = [
        ChatExample(token_ids=list(range(100, 100 + n)), loss_mask=[0] + [1] * (n - 1)) for n in (7, 3, 9, 5, 2, 6, 4)
    ]
    for pack in (True, False):
        batches = micro_batches(examples, max_row_tokens=10, max_batch_tokens=20, pad_token_id=0, pack=pack)
        assert all(b.layout.num_slots <= 20 and b.layout.input_ids.shape[1] <= 10 for b in batches)
        assert sum(b.num_trained_tokens for b in batches) == sum(e.num_trained_tokens for e in examples)
        tokens = sorted(t for b in batches for t in b.layout.input_ids[b.layout.input_ids > 0].tolist())
        assert tokens == sorted(t for e in examples for t in e.token_ids)


@pytest.fixture(scope="module")
def demo_examples():
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    with open(PROJECT_ROOT / "data" / "demo" / "sft.jsonl") as handle:
        records = [json.loads(next(handle)) for _ in range(10)]
    return [render_chat(record, tokenizer) for record in records], tokenizer.pad_token_id


def loss_and_gradient(model, batches):
    """The global-batch mean NLL over assistant tokens, accumulated over micro-batches, and its gradient."""
    model.zero_grad(set_to_none=True)
    norm = Normalisers(num_tokens=sum(b.num_trained_tokens for b in batches), num_sequences=0)
    total = 0.0
    for batch in batches:
        loss = nll_loss(model, batch, norm)
        loss.backward()
        total += loss.item()
    return total, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("attn_implementation, checkpointing", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_and_unpacked_batches_give_the_same_loss_and_gradients(
    demo_examples, attn_implementation, checkpointing
):
    """Packed: segment attention (with activation checkpointing, in the recompute too); unpacked: the
    model's own attention over one padded example per row."""
    examples, pad_id = demo_examples
    model = AutoModelForCausalLM.from_pretrained(DEMO, attn_implementation=attn_implementation, dtype=torch.float32)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    packed = micro_batches(examples, max_row_tokens=256, max_batch_tokens=512, pad_token_id=pad_id, pack=True)
    unpacked = micro_batches(examples, max_row_tokens=256, max_batch_tokens=512, pad_token_id=pad_id, pack=False)
    assert (
        max(len(b.layout.input_ids) for b in packed) < len(examples)
        and max(b.layout.input_ids.shape[1] for b in packed) > 100
    )
    packed_loss, packed_grad = loss_and_gradient(model, packed)
    unpacked_loss, unpacked_grad = loss_and_gradient(model, unpacked)
    assert packed_loss == pytest.approx(unpacked_loss, abs=1e-5)
    torch.testing.assert_close(packed_grad, unpacked_grad, atol=1e-5, rtol=0)


def test_without_segments_the_examples_of_a_row_would_see_each_other(demo_examples):
    """The control for the test above: the same packed rows as one long sequence each (no segments,
    positions 0..W-1) give another loss, so the equality there is the segments' doing."""
    examples, pad_id = demo_examples
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    packed = micro_batches(examples, max_row_tokens=256, max_batch_tokens=512, pad_token_id=pad_id, pack=True)
    loss, _ = loss_and_gradient(model, packed)
    for batch in packed:
        layout = batch.layout
        layout.segments, layout.attention_mask = None, torch.ones_like(layout.input_ids)
        layout.position_ids = torch.arange(layout.input_ids.shape[1]).expand_as(layout.input_ids)
    leaky_loss, _ = loss_and_gradient(model, packed)
    assert abs(leaky_loss - loss) > 1e-3
