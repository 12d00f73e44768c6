"""Sequence packing: whole examples laid end to end in rows, rows grouped into micro-batches by tokens.

Rows are filled first-fit decreasing (longest example first, into the first row it fits), each row
holding at most `max_row_tokens`. Examples are never split. Inside a row, `position_ids` restart at 0
for every example, and the attention of each token stays within its own example.

How the attention is confined: the model is called with `position_ids`, no attention mask and no KV
cache. transformers (5.x, `masking_utils.find_packed_sequence_indices`) then reads a drop in the
position ids as the start of a new sequence and builds a block-diagonal causal mask for the `sdpa` and
`eager` implementations. Passing an attention mask, or a cache, turns that off, so `packed_logits`
never passes either. tests/unit/test_packing.py holds it: a packed batch gives the same loss and
gradients as the same examples padded one per row.

The padding at the end of a row is one more "sequence" of its own (positions 0, 1, ...): nothing real
attends to it, and its loss mask is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reinforge.data.chat import ChatExample

# Attention implementations checked to build the block-diagonal mask from position ids in a [R, T] batch.
# flash_attention_2 detects packing only in a single row ([1, T]); it is not supported here yet.
PACKED_ATTENTION = ("sdpa", "eager")


@dataclass
class PackedBatch:
    """One micro-batch: R rows of T positions, each row some whole examples end to end, right-padded."""

    input_ids: torch.Tensor  # [R, T] long
    position_ids: torch.Tensor  # [R, T] long: 0, 1, ... restarting at each example and at the padding
    loss_mask: torch.Tensor  # [R, T] float: 1 on trained (assistant) tokens
    num_real_tokens: int  # tokens that are not padding

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_slots(self) -> int:
        """R x T: the positions a forward pass computes, padding included."""
        return self.input_ids.numel()


def first_fit_decreasing(lengths: list[int], max_row_tokens: int) -> list[list[int]]:
    """Indices of the examples in each row: longest first, each into the first row with room."""
    assert max(lengths, default=0) <= max_row_tokens, "an example is longer than a row; truncate it first"
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            room.append(max_row_tokens)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def group_rows(row_lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Rows per micro-batch, longest first, so that rows x the longest row <= max_batch_tokens."""
    assert max(row_lengths, default=0) <= max_batch_tokens, "a row is longer than a micro-batch's token budget"
    groups: list[list[int]] = []
    for index in sorted(range(len(row_lengths)), key=lambda i: (-row_lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * row_lengths[groups[-1][0]] <= max_batch_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def collate_rows(rows: list[list[ChatExample]], pad_token_id: int) -> PackedBatch:
    """Lay each row's examples end to end and right-pad the rows to the longest."""
    width = max(sum(len(e) for e in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, row in enumerate(rows):
        start = 0
        for example in row:
            end = start + len(example)
            input_ids[r, start:end] = torch.tensor(example.token_ids)
            position_ids[r, start:end] = torch.arange(len(example))
            loss_mask[r, start:end] = torch.tensor(example.loss_mask, dtype=torch.float32)
            start = end
        position_ids[r, start:] = torch.arange(width - start)
    num_real = sum(len(e) for row in rows for e in row)
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, loss_mask=loss_mask, num_real_tokens=num_real)


def micro_batches(
    examples: list[ChatExample], max_row_tokens: int, max_batch_tokens: int, pad_token_id: int, pack: bool = True
) -> list[PackedBatch]:
    """All examples in micro-batches of at most `max_batch_tokens` positions: packed rows, or with
    `pack=False` one example per row (grouped by length, which keeps the padding small)."""
    for example in examples:
        # The first token of an example is predicted from the last token of the one before it in the
        # row: it must never be trained on (render_chat guarantees it).
        assert example.loss_mask[0] == 0, "an example's first token is in the loss mask"
    lengths = [len(e) for e in examples]
    rows = first_fit_decreasing(lengths, max_row_tokens) if pack else [[i] for i in range(len(examples))]
    row_lengths = [sum(lengths[i] for i in row) for row in rows]
    return [
        collate_rows([[examples[i] for i in rows[r]] for r in group], pad_token_id)
        for group in group_rows(row_lengths, max_batch_tokens)
    ]


def packed_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Logits [R, T, V] with attention confined to each example (see the module docstring)."""
    assert model.config._attn_implementation in PACKED_ATTENTION, model.config._attn_implementation
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None, use_cache=False).logits


# --- Row layouts for the RL training backends --------------------------------------------------
# The backends' batches are right-padded [B, T] TrainBatches (data/batch.py). A `RowLayout` is where a
# forward pass puts those sequences: packed end to end in rows (first-fit decreasing, positions
# restarting per sequence, as above), one per row as they come (with their attention mask), or packed
# with shared prompts (the samples of one prompt attending to one copy of it, below). Whichever layout
# it is, `token_index[b, t]` says where token t of sequence b sits in the flattened [R * W] layout.


@dataclass
class RowLayout:
    """B sequences in R rows of W positions, for one forward pass."""

    input_ids: torch.Tensor  # [R, W] long
    position_ids: torch.Tensor  # [R, W] long: 0, 1, ... from each sequence's start (and the row's padding)
    # [R, W]: one sequence per row; None when packed (positions mark the boundaries); [R, 1, W, W] bool
    # (True: may attend) with shared prompts
    attention_mask: torch.Tensor | None
    token_index: torch.Tensor  # [B, T] long: row * W + column of each real token of each sequence
    num_real_tokens: int  # tokens that are not padding

    @property
    def num_slots(self) -> int:
        """R x W: the positions the forward pass computes, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> "RowLayout":
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return RowLayout(self.input_ids.to(device), self.position_ids.to(device), mask, self.token_index.to(device),
                         self.num_real_tokens)


def padded_layout(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> RowLayout:
    """One sequence per row, right-padded as they are (the unpacked reference)."""
    num_rows, width = input_ids_BT.shape
    return RowLayout(
        input_ids=input_ids_BT,
        position_ids=torch.arange(width).expand(num_rows, width),
        attention_mask=attention_mask_BT,
        token_index=torch.arange(num_rows * width, device=input_ids_BT.device).view(num_rows, width),
        num_real_tokens=int(attention_mask_BT.sum()),
    )


def packed_layout(input_ids_BT: torch.Tensor, lengths_B: list[int], rows: list[list[int]], pad_token_id: int) -> RowLayout:
    """The sequences end to end in the given rows (indices into the B sequences), right-padded to the
    longest row."""
    width = max(sum(lengths_B[b] for b in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    token_index = torch.zeros(input_ids_BT.shape, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for b in row:
            end = start + lengths_B[b]
            input_ids[r, start:end] = input_ids_BT[b, : lengths_B[b]]
            position_ids[r, start:end] = torch.arange(lengths_B[b])
            token_index[b, : lengths_B[b]] = torch.arange(r * width + start, r * width + end)
            start = end
        position_ids[r, start:] = torch.arange(width - start)  # the row's padding: a "sequence" of its own
    return RowLayout(input_ids=input_ids, position_ids=position_ids, attention_mask=None, token_index=token_index,
                     num_real_tokens=sum(lengths_B))


# --- Shared prompts ---------------------------------------------------------------------------
# The G samples of a GRPO prompt repeat its tokens G times. In a shared-prompt row the prompt is laid
# out once, then each sample's response, at positions P, P+1, ... and attending to the prompt and to
# itself only (an explicit [W, W] mask). Every hidden state is the same function of the same inputs as
# in the unshared layout, and the prompt's gradient is the sum over the samples, as it was: same
# logprobs, loss and gradients, with the prompt's G-1 copies not computed. The dense mask makes the
# attention cost grow with the square of the row, so `shared_prompt_rows` shares a prompt among as many
# samples as a FLOP estimate says pays (all G on short prompts and responses, fewer or none on long ones).


def prompt_keys(input_ids_BT: torch.Tensor, prompt_lengths_B: list[int]) -> list[int]:
    """One id per distinct prompt (its tokens): sequences with the same id have the same prompt."""
    ids: dict[bytes, int] = {}
    return [ids.setdefault(input_ids_BT[b, :n].numpy().tobytes(), len(ids)) for b, n in enumerate(prompt_lengths_B)]


def shared_prompt_rows(lengths: list[int], prompt_lengths: list[int], keys: list[int], pair_cost: float) -> tuple[list[list[int]], list[int]]:
    """(rows of sequence indices, each row's width). The samples of each prompt are split into runs of k
    consecutive sequences (a run: its prompt once, then the k responses); k minimises the estimated cost,
    `width + pair_cost * width**2` per run (the tokens' matmuls, plus attention over the dense mask, in
    units of one token's matmuls), against packing the sequences unshared (k = 1). The runs are then
    packed first-fit decreasing into rows as wide as the widest run."""
    widest = max(lengths)
    groups: dict[int, list[int]] = {}
    for b, key in enumerate(keys):
        groups.setdefault(key, []).append(b)

    def width(run: list[int]) -> int:  # the prompt once, then every answer
        return prompt_lengths[run[0]] + sum(lengths[b] - prompt_lengths[b] for b in run)

    runs: list[list[int]] = []
    for members in groups.values():
        def cost(k: int) -> float:
            if k == 1:
                return sum(lengths[b] + pair_cost * lengths[b] * widest for b in members)
            return sum(width(run) + pair_cost * width(run) ** 2 for run in (members[i : i + k] for i in range(0, len(members), k)))
        k = min(range(1, len(members) + 1), key=lambda k: (cost(k), k))
        runs.extend(members[start : start + k] for start in range(0, len(members), k))
    widths = [width(run) for run in runs]
    rows = first_fit_decreasing(widths, max(widths))
    return [[b for r in row for b in runs[r]] for row in rows], [sum(widths[r] for r in row) for row in rows]


def shared_prompt_layout(input_ids_BT: torch.Tensor, lengths_B: list[int], prompt_lengths_B: list[int], rows: list[list[int]],
                         pad_token_id: int) -> RowLayout:
    """The rows' sequences end to end, where consecutive sequences of a row with the same prompt share one
    copy of it; the attention mask [R, 1, W, W] keeps each token to its own sequence's tokens."""
    segments: list[list[tuple[int, int, int, int]]] = []  # per row: (sequence, first token, run, sample) pieces
    for row in rows:
        pieces, run, sample, previous = [], -1, 0, None
        for b in row:
            prompt = prompt_lengths_B[b]
            if (previous is not None and prompt == prompt_lengths_B[previous] and 0 < prompt < lengths_B[b]
                    and torch.equal(input_ids_BT[b, :prompt], input_ids_BT[previous, :prompt])):
                sample += 1
                pieces.append((b, prompt, run, sample))
            else:
                run, sample = run + 1, 0
                pieces.append((b, 0, run, 0))
            previous = b
        segments.append(pieces)
    width = max(sum(lengths_B[b] - first for b, first, _, _ in pieces) for pieces in segments)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    run_ids = torch.full((len(rows), width), -1, dtype=torch.long)  # the padding is a run of its own
    sample_ids = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: the prompt, seen by all samples
    token_index = torch.zeros(input_ids_BT.shape, dtype=torch.long)
    for r, pieces in enumerate(segments):
        start, run_first = 0, {}
        for b, first, run, sample in pieces:
            end = start + lengths_B[b] - first
            input_ids[r, start:end] = input_ids_BT[b, first : lengths_B[b]]
            position_ids[r, start:end] = torch.arange(first, lengths_B[b])
            run_ids[r, start:end] = run
            sample_ids[r, start + (prompt_lengths_B[b] if first == 0 else 0) : end] = sample
            if first == 0:
                run_first[run] = b
            else:  # the shared prompt's tokens are the first sample's
                token_index[b, :first] = token_index[run_first[run], :first]
            token_index[b, first : lengths_B[b]] = torch.arange(r * width + start, r * width + end)
            start = end
        position_ids[r, start:] = torch.arange(width - start)
    same_run = run_ids[:, :, None] == run_ids[:, None, :]
    causal = position_ids[:, None, :] <= position_ids[:, :, None]
    visible = (sample_ids[:, None, :] == -1) | (sample_ids[:, None, :] == sample_ids[:, :, None])
    mask = (same_run & causal & visible).unsqueeze(1)
    return RowLayout(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, token_index=token_index,
                     num_real_tokens=sum(lengths_B))


def sequence_rows(lengths: list[int], pack: bool) -> list[list[int]]:
    """Rows of sequence indices: first-fit decreasing into rows as wide as the longest sequence (so a
    packed row never makes attention costlier than the padded layout does), or one sequence per row."""
    return first_fit_decreasing(lengths, max(lengths)) if pack else [[i] for i in range(len(lengths))]


def rows_by_token_budget(rows: list[list[int]], widths: list[int], max_batch_tokens: int) -> list[list[list[int]]]:
    """The rows (of the given widths) grouped into micro-batches whose forward computes at most
    `max_batch_tokens` positions (rows x the widest row); a row wider than the budget is a micro-batch of its own."""
    widths = [min(width, max_batch_tokens) for width in widths]
    return [[rows[r] for r in group] for group in group_rows(widths, max_batch_tokens)]
