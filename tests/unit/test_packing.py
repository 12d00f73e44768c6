"""Sequence packing: rows, micro-batches, and SFT's packed attention equal to one conversation per row.

SFT trains through the training backend (training/backend.py), which plans its micro-batches with
`plan_micro_batches` (rows of `data.max_seq_len` tokens) and lays them out with `row_layout`; these tests
go through that path, built as the supervised loop builds SFT's from configs/sft_demo.yaml.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforge.algorithms.sft import examples_batch, nll_loss
from reinforge.algorithms.sft_config import SFTRunConfig, SFTTrainingConfig
from reinforge.config.loader import load_recipe_config
from reinforge.data.chat import ChatExample, render_chat
from reinforge.data.packing import dense_mask, first_fit_decreasing, padded_layout, row_layout, rows_by_token_budget
from reinforge.loops.builders import build_recipe_backend
from reinforge.paths import PROJECT_ROOT
from reinforge.training import lora
from reinforge.training.heads import LogprobHead
from reinforge.training.micro_batching import plan_micro_batches

DEMO = PROJECT_ROOT / "models" / "demo"
CONFIG = PROJECT_ROOT / "configs" / "sft_demo.yaml"


def test_first_fit_decreasing_puts_each_example_in_the_first_row_with_room():
    """Lengths [5, 3, 4, 2, 6], rows of 8. Longest first: 6 -> row 0 (2 left); 5 -> row 1 (3 left);
    4 -> row 2 (4 left); 3 -> row 1 (0 left); 2 -> row 0 (0 left)."""
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]


def test_rows_are_grouped_so_that_rows_times_the_widest_fit_the_token_budget():
    """Row widths [8, 3, 8, 4, 20], budget 16. Widest first: 20 is over the budget, alone; 8 and 8 fill
    2 x 8 = 16; a third row would make 3 x 8 = 24, so 4 and 3 start another: 2 x 4 = 8."""
    rows = [[10], [11, 12], [13], [14], [15]]
    assert rows_by_token_budget(rows, [8, 3, 8, 4, 20], 16) == [[[15]], [[10], [13]], [[14], [11, 12]]]


def test_positions_restart_for_every_example_and_padding_is_never_trained():
    """Rows [a, b] and [c] of lengths 3 + 2 and 4: width 5, row 1 padded by one. The trained tokens
    (loss masks [0, 1, 1], [0, 1], [0, 0, 1, 1]) sit at flat positions 1, 2, 4 and 5 + 2, 5 + 3."""
    a = ChatExample(token_ids=[11, 12, 13], loss_mask=[0, 1, 1])
    b = ChatExample(token_ids=[21, 22], loss_mask=[0, 1])
    c = ChatExample(token_ids=[31, 32, 33, 34], loss_mask=[0, 0, 1, 1])
    batch = examples_batch([a, b, c], pad_id=0)
    lengths = batch.attention_mask.sum(1).tolist()
    layout = row_layout(batch.input_ids, lengths, [[0, 1], [2]], pad_token_id=0)
    assert layout.input_ids.tolist() == [[11, 12, 13, 21, 22], [31, 32, 33, 34, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert layout.token_index[batch.loss_mask.bool()].tolist() == [1, 2, 4, 7, 8]
    assert (layout.num_real_tokens, batch.num_valid_tokens(), layout.num_slots) == (9, 5, 10)
    causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in (3, 2, 4)]
    assert torch.equal(dense_mask(layout), torch.block_diag(*causal, torch.zeros(1, 1, dtype=torch.bool)))
    padded = padded_layout(batch.input_ids, batch.attention_mask)
    assert padded.input_ids.tolist() == [[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]]
    assert padded.token_index[batch.loss_mask.bool()].tolist() == [1, 2, 5, 10, 11] and padded.segments is None


@pytest.mark.parametrize(
    "pack, expected",
    [
        # rows of 10, first-fit decreasing: [9], [7, 3], [6, 4], [5, 2] (widths 9, 10, 10, 7); then
        # widest first, 2 x 10 = 20 and 2 x 9 = 18
        (True, [[[0, 1], [5, 6]], [[2], [3, 4]]]),
        # one per row, widest first: 2 x 9 = 18; 3 x 6 = 18; 2 x 3 = 6
        (False, [[[2], [0]], [[5], [3], [6]], [[1], [4]]]),
    ],
)
def test_sft_micro_batches_hold_every_conversation_once_within_the_token_budget(pack, expected):
    """Lengths [7, 3, 9, 5, 2, 6, 4], rows of data.max_seq_len = 10, micro-batches of 20 positions."""
    lengths = [7, 3, 9, 5, 2, 6, 4]
    config = SFTTrainingConfig(micro_batch_tokens=20, sequence_packing=pack).backend_config()
    plan = plan_micro_batches(lengths, config, row_tokens=10)
    assert plan == expected
    assert sorted(i for rows in plan for row in rows for i in row) == list(range(len(lengths)))
    widths = [[sum(lengths[i] for i in row) for row in rows] for rows in plan]
    assert all(max(w) <= 10 and len(w) * max(w) <= 20 for w in widths)


@pytest.fixture(scope="module")
def demo_batch():
    """The first 10 demo chats (52-74 tokens each) as SFT's right-padded batch."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    with open(PROJECT_ROOT / "data" / "demo" / "sft.jsonl") as handle:
        records = [json.loads(next(handle)) for _ in range(10)]
    return examples_batch([render_chat(record, tokenizer) for record in records], tokenizer.pad_token_id)


def sft_backend(packing: bool, attn_implementation: str = "sdpa", checkpointing: bool = False):
    """SFT's backend on the demo model's trained weights, micro-batches of 512 positions (rows of 256)."""
    overrides = [
        "sft.random_init=false",
        f"training.sequence_packing={str(packing).lower()}",
        f"training.activation_checkpointing={str(checkpointing).lower()}",
        "training.micro_batch_tokens=512",
    ]
    config = load_recipe_config(SFTRunConfig, CONFIG, overrides)
    assert config.model.name_or_path == "models/demo" and config.data.max_seq_len == 256
    head = LogprobHead(temperature=1.0, load_model=lora.load_policy)  # sft.SFT's, from trained weights
    backend = build_recipe_backend(config, config.sft.max_steps, head, None, row_tokens=config.data.max_seq_len)
    backend.model.set_attn_implementation(attn_implementation)
    return backend


def loss_and_gradient(backend, batch):
    """The global-batch mean NLL over assistant tokens, accumulated over micro-batches, and its gradient."""
    backend.optimizer.zero_grad(set_to_none=True)
    metrics = backend.accumulate_gradients(batch, nll_loss)
    return metrics["loss"], torch.cat([p.grad.flatten() for p in backend.model.parameters()])


@pytest.mark.parametrize("attn_implementation, checkpointing", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_and_unpacked_micro_batches_give_the_same_loss_and_gradients(
    demo_batch, attn_implementation, checkpointing
):
    """Packed: segment attention (with activation checkpointing, in the recompute too); unpacked: the
    model's own attention over one padded conversation per row. Both accumulate over micro-batches."""
    packed = sft_backend(True, attn_implementation, checkpointing)
    unpacked = sft_backend(False, attn_implementation, checkpointing)
    lengths = demo_batch.attention_mask.sum(1).tolist()
    packed_rows = [row for rows in packed.plan(lengths, None) for row in rows]
    assert sorted(len(row) for row in packed_rows) == [1, 3, 3, 3]  # first-fit decreasing, rows of 256
    assert len(packed.plan(lengths, None)) > 1 and len(unpacked.plan(lengths, None)) > 1
    assert all(len(row) == 1 for rows in unpacked.plan(lengths, None) for row in rows)
    packed_loss, packed_grad = loss_and_gradient(packed, demo_batch)
    unpacked_loss, unpacked_grad = loss_and_gradient(unpacked, demo_batch)
    assert packed_grad.abs().max() > 1e-3
    assert packed_loss == pytest.approx(unpacked_loss, abs=1e-5)
    torch.testing.assert_close(packed_grad, unpacked_grad, atol=1e-5, rtol=0)


def plain_forward_loss(model, layout, batch) -> float:
    """The mean NLL over the batch's assistant tokens from one plain forward over `layout`'s rows (the model's
    own attention, `layout.attention_mask` or all ones, positions 0..W-1): token t of a conversation is
    predicted from the logits at the layout position of its token t - 1."""
    mask = layout.attention_mask if layout.attention_mask is not None else torch.ones_like(layout.input_ids)
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, attention_mask=mask, use_cache=False).logits
    logprobs = torch.log_softmax(logits.flatten(0, 1).float(), dim=-1)
    b_index, t_index = batch.loss_mask.nonzero(as_tuple=True)
    picked = logprobs[layout.token_index[b_index, t_index - 1], batch.input_ids[b_index, t_index]]
    return float(-picked.sum() / len(picked))


def test_without_segments_the_conversations_of_a_row_would_see_each_other(demo_batch):
    """The control for the test above: the packed backend's rows computed as one long sequence each (no
    segments, positions 0..W-1, full causal attention) give another loss, so the equality there is the
    segments' doing. The same plain forward over one padded conversation per row gives the backend's loss,
    so the difference is not the plain forward's."""
    backend = sft_backend(True)
    loss, _ = loss_and_gradient(backend, demo_batch)
    lengths = demo_batch.attention_mask.sum(1).tolist()
    rows = [row for rows in backend.plan(lengths, None) for row in rows]
    layout = row_layout(demo_batch.input_ids, lengths, rows, pad_token_id=0)
    assert layout.segments is not None and layout.input_ids.shape[1] > 150
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    padded = padded_layout(demo_batch.input_ids, demo_batch.attention_mask)
    assert plain_forward_loss(model, padded, demo_batch) == pytest.approx(loss, abs=1e-5)
    assert abs(plain_forward_loss(model, layout, demo_batch) - loss) > 1e-3
