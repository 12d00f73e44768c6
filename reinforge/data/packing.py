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
# with shared prompts (the samples of one prompt attending to one copy of it, below; who attends to
# whom is then a list of `SegmentBucket`s). Whichever layout it is, `token_index[b, t]` says where
# token t of sequence b sits in the flattened [R * W] layout.


# segments whose key length is within this ratio of the longest in their bucket share one padded call
BUCKET_RATIO = 0.75


@dataclass
class SegmentBucket:
    """N segments padded to Q queries and K keys; indices are flat positions in the [R * W] layout."""

    query_index: torch.Tensor  # [N, Q] long (0 on padding)
    key_index: torch.Tensor  # [N, K] long (0 on padding)
    mask: torch.Tensor  # [N, 1, Q, K] bool: True where the query may attend to the key
    query_valid: torch.Tensor  # [N, Q] bool

    def to(self, device: torch.device) -> "SegmentBucket":
        return SegmentBucket(*(t.to(device) for t in (self.query_index, self.key_index, self.mask, self.query_valid)))


def segment_buckets(segments: list[tuple[int, int, int, int]], position_ids_flat: torch.Tensor) -> list[SegmentBucket]:
    """Buckets of segments (query start, query end, prefix start, prefix end): the queries [start, end)
    attend to the prefix [prefix start, prefix end) (empty: none) and causally, by position id, to the
    queries' own range. Padded query rows see one real key, so that no row is all masked (some kernels
    give NaN there, and NaN times a zero gradient is NaN); their output is dropped."""
    keys = [(end - start) + (prefix_end - prefix_start) for start, end, prefix_start, prefix_end in segments]
    order = sorted(range(len(segments)), key=lambda i: keys[i], reverse=True)
    groups: list[list[int]] = []
    for i in order:
        if groups and keys[i] >= BUCKET_RATIO * keys[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    buckets = []
    for group in groups:
        start, end, prefix_start, prefix_end = torch.tensor([segments[i] for i in group]).unbind(1)
        length, prefix = end - start, prefix_end - prefix_start
        q = torch.arange(int(length.max()))
        k = torch.arange(int((length + prefix).max()))
        query_valid = q[None, :] < length[:, None]
        key_valid = k[None, :] < (length + prefix)[:, None]
        query_index = torch.where(query_valid, start[:, None] + q[None, :], 0)
        in_prefix = k[None, :] < prefix[:, None]
        key_index = torch.where(in_prefix, prefix_start[:, None] + k[None, :], start[:, None] + k[None, :] - prefix[:, None])
        key_index = torch.where(key_valid, key_index, 0)
        causal = position_ids_flat[key_index][:, None, :] <= position_ids_flat[query_index][:, :, None]
        mask = causal & key_valid[:, None, :] & query_valid[:, :, None]
        mask[:, :, 0] |= ~query_valid
        buckets.append(SegmentBucket(query_index, key_index, mask.unsqueeze(1), query_valid))
    return buckets


def dense_mask(buckets: list[SegmentBucket], num_slots: int) -> torch.Tensor:
    """The [R * W, R * W] mask the buckets amount to (for tests): entry [i, j] is whether position i attends to j."""
    mask = torch.zeros(num_slots, num_slots, dtype=torch.bool)
    for bucket in buckets:
        for n, q in bucket.query_valid.nonzero().tolist():
            mask[bucket.query_index[n, q], bucket.key_index[n][bucket.mask[n, 0, q]]] = True
    return mask


@dataclass
class RowLayout:
    """B sequences in R rows of W positions, for one forward pass."""

    input_ids: torch.Tensor  # [R, W] long
    position_ids: torch.Tensor  # [R, W] long: 0, 1, ... from each sequence's start (and the row's padding)
    # [R, W]: one sequence per row; None when packed (positions mark the boundaries) or segmented
    attention_mask: torch.Tensor | None
    token_index: torch.Tensor  # [B, T] long: row * W + column of each real token of each sequence
    num_real_tokens: int  # tokens that are not padding
    # shared prompts: who attends to whom, for training/segment_attention.py (None: the model's own attention)
    segments: list[SegmentBucket] | None = None

    @property
    def num_slots(self) -> int:
        """R x W: the positions the forward pass computes, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> "RowLayout":
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        segments = None if self.segments is None else [bucket.to(device) for bucket in self.segments]
        return RowLayout(self.input_ids.to(device), self.position_ids.to(device), mask, self.token_index.to(device),
                         self.num_real_tokens, segments)


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
# itself only. Every hidden state is the same function of the same inputs as in the unshared layout,
# and the prompt's gradient is the sum over the samples, as it was: same logprobs, loss and gradients,
# with the prompt's G-1 copies not computed. Who attends to whom is given as segments (a prompt; an
# answer with its prompt as prefix) for training/segment_attention.py, which computes each segment on
# its own, so sharing never costs attention beyond what the unshared sequences would.


def prompt_keys(input_ids_BT: torch.Tensor, prompt_lengths_B: list[int]) -> list[int]:
    """One id per distinct prompt (its tokens): sequences with the same id have the same prompt."""
    ids: dict[bytes, int] = {}
    return [ids.setdefault(input_ids_BT[b, :n].numpy().tobytes(), len(ids)) for b, n in enumerate(prompt_lengths_B)]


def shared_prompt_rows(lengths: list[int], prompt_lengths: list[int], keys: list[int], max_run_tokens: int | None
                       ) -> tuple[list[list[int]], list[int]]:
    """(rows of sequence indices, each row's width). The samples of each prompt form runs of consecutive
    sequences (a run: its prompt once, then the answers), as long as `max_run_tokens` allows (None: one
    run per prompt; a sample longer than the limit is a run of its own). The runs are then packed
    first-fit decreasing into rows as wide as the widest run."""
    groups: dict[int, list[int]] = {}
    for b, key in enumerate(keys):
        groups.setdefault(key, []).append(b)
    runs: list[list[int]] = []
    widths: list[int] = []
    for first, *others in groups.values():
        runs.append([first])
        widths.append(lengths[first])
        for b in others:  # the run grows by the answer only; a new run starts with its own prompt
            grown = widths[-1] + lengths[b] - prompt_lengths[b]
            if max_run_tokens is None or grown <= max_run_tokens:
                runs[-1].append(b)
                widths[-1] = grown
            else:
                runs.append([b])
                widths.append(lengths[b])
    rows = first_fit_decreasing(widths, max(widths))
    return [[b for r in row for b in runs[r]] for row in rows], [sum(widths[r] for r in row) for row in rows]


def shared_prompt_layout(input_ids_BT: torch.Tensor, lengths_B: list[int], prompt_lengths_B: list[int], rows: list[list[int]],
                         pad_token_id: int) -> RowLayout:
    """The rows' sequences end to end, where consecutive sequences of a row with the same prompt share one
    copy of it; the segments keep each token to its own sequence's tokens."""
    width = 0
    pieces_per_row: list[list[tuple[int, int]]] = []  # per row: (sequence, first token laid out) pieces
    for row in rows:
        pieces, previous = [], None
        for b in row:
            prompt = prompt_lengths_B[b]
            shares = (previous is not None and prompt == prompt_lengths_B[previous] and 0 < prompt < lengths_B[b]
                      and torch.equal(input_ids_BT[b, :prompt], input_ids_BT[previous, :prompt]))
            pieces.append((b, prompt if shares else 0))
            previous = b
        pieces_per_row.append(pieces)
        width = max(width, sum(lengths_B[b] - first for b, first in pieces))
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    token_index = torch.zeros(input_ids_BT.shape, dtype=torch.long)
    segments: list[tuple[int, int, int, int]] = []  # (query start, end, prefix start, prefix end), flat positions
    for r, pieces in enumerate(pieces_per_row):
        start, owner = 0, -1  # owner: the sequence whose copy of the prompt the run's samples read
        for b, first in pieces:
            end = start + lengths_B[b] - first
            input_ids[r, start:end] = input_ids_BT[b, first : lengths_B[b]]
            position_ids[r, start:end] = torch.arange(first, lengths_B[b])
            token_index[b, first : lengths_B[b]] = torch.arange(r * width + start, r * width + end)
            flat, prompt = r * width + start, prompt_lengths_B[b]
            if first:  # an answer reading the run's prompt, laid out at the start of its owner
                token_index[b, :first] = token_index[owner, :first]
                prefix = int(token_index[owner, 0])
                segments.append((flat, flat + end - start, prefix, prefix + first))
            elif 0 < prompt < lengths_B[b]:  # the prompt, then the answer reading it
                owner = b
                segments += [(flat, flat + prompt, flat, flat), (flat + prompt, flat + end - start, flat, flat + prompt)]
            else:
                owner = b
                segments.append((flat, flat + end - start, flat, flat))
            start = end
        position_ids[r, start:] = torch.arange(width - start)
    return RowLayout(input_ids=input_ids, position_ids=position_ids, attention_mask=None, token_index=token_index,
                     num_real_tokens=sum(lengths_B), segments=segment_buckets(segments, position_ids.flatten()))


def sequence_rows(lengths: list[int], pack: bool) -> list[list[int]]:
    """Rows of sequence indices: first-fit decreasing into rows as wide as the longest sequence (so a
    packed row never makes attention costlier than the padded layout does), or one sequence per row."""
    return first_fit_decreasing(lengths, max(lengths)) if pack else [[i] for i in range(len(lengths))]


def rows_by_token_budget(rows: list[list[int]], widths: list[int], max_batch_tokens: int) -> list[list[list[int]]]:
    """The rows (of the given widths) grouped into micro-batches whose forward computes at most
    `max_batch_tokens` positions (rows x the widest row); a row wider than the budget is a micro-batch of its own."""
    widths = [min(width, max_batch_tokens) for width in widths]
    return [[rows[r] for r in group] for group in group_rows(widths, max_batch_tokens)]
