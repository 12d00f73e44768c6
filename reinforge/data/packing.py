"""Sequence packing: whole sequences laid end to end in rows, and who attends to whom inside a row.

Rows are filled first-fit decreasing (longest sequence first, into the first row it fits). Sequences are
never split. Inside a row, `position_ids` restart at 0 for every sequence; the padding at the end of a
row is one more "sequence" of its own (positions 0, 1, ...), which nothing real attends to.

One layout builder, `row_layout`, serves every recipe through the training backend's micro-batches
(training/micro_batching.py): SFT's conversations and the RL recipes' sequences alike, as right-padded
[B, T] TrainBatches (data/batch.py). Given prompt lengths it shares prompts: consecutive samples of one
prompt in a row hold the prompt once, each answer at positions P, P+1, ... attending to the prompt and
to itself only. Every hidden state is then the same function of the same inputs as unshared, and the
prompt's gradient the sum over its samples, as it was: same logprobs, loss and gradients, with the
prompt's G-1 copies not computed. Without prompt lengths nothing is shared: unshared packing is the case
where no prompt is shared.

Who attends to whom is a list of segments (a query range attending to a key prefix and, causally, to
itself), grouped into `SegmentBucket`s of similar length and computed by training/segment_attention.py
whatever the model's own attention implementation (tests/unit/test_packing_rl.py: sdpa and eager).
`padded_layout` is the unpacked reference: one sequence per row with its attention
mask, through the model's own attention. Whichever layout it is, `token_index[b, t]` says where token
t of sequence b sits in the flattened [R * W] layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# segments whose key length is within this ratio of the longest in their bucket share one padded call
BUCKET_RATIO = 0.75


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


@dataclass
class SegmentBucket:
    """N segments padded to Q queries and K keys; indices are flat positions in the [R * W] layout. The
    [N, 1, Q, K] mask is built from them on the device that runs the pass (`with_mask`): a layout kept
    for later passes holds indices only."""

    query_index: torch.Tensor  # [N, Q] long (0 on padding)
    key_index: torch.Tensor  # [N, K] long (0 on padding)
    query_valid: torch.Tensor  # [N, Q] bool
    key_valid: torch.Tensor  # [N, K] bool
    mask: torch.Tensor | None = None  # [N, 1, Q, K] bool: True where the query may attend to the key
    positions: tuple[torch.Tensor, torch.Tensor] | None = None  # the queries' [N, Q] and keys' [N, K] position ids

    def with_mask(self, position_ids_flat: torch.Tensor) -> "SegmentBucket":
        """This bucket with its mask: causal by position id, within each segment's valid keys. Padded
        query rows see one real key, so that no row is all masked (some kernels give NaN there, and NaN
        times a zero gradient is NaN); their output is dropped."""
        positions = position_ids_flat[self.query_index], position_ids_flat[self.key_index]
        causal = positions[1][:, None, :] <= positions[0][:, :, None]
        mask = causal & self.key_valid[:, None, :] & self.query_valid[:, :, None]
        mask[:, :, 0] |= ~self.query_valid
        return replace(self, mask=mask.unsqueeze(1), positions=positions)

    def window_mask(self, sliding_window: int) -> torch.Tensor:
        """`mask` within a sliding window of `sliding_window` positions, transformers' rule (masking_utils.py,
        `sliding_window_overlay`: a key is kept when its position is above the query's minus the window), by the
        tokens' own positions, so a shared prompt's answers count from their prompt's start."""
        assert self.mask is not None and self.positions is not None, "the layout's masks are built by RowLayout.to"
        query_position, key_position = self.positions
        inside = key_position[:, None, None, :] > query_position[:, None, :, None] - sliding_window
        return self.mask & (inside | ~self.query_valid[:, None, :, None])  # a padded query keeps its one key

    def to(self, device: torch.device) -> "SegmentBucket":
        return SegmentBucket(
            *(t.to(device) for t in (self.query_index, self.key_index, self.query_valid, self.key_valid))
        )


def segment_buckets(segments: list[tuple[int, int, int, int]]) -> list[SegmentBucket]:
    """Buckets of segments (query start, query end, prefix start, prefix end): the queries [start, end)
    attend to the prefix [prefix start, prefix end) (empty: none) and causally to the queries' own range."""
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
        key_index = torch.where(
            in_prefix, prefix_start[:, None] + k[None, :], start[:, None] + k[None, :] - prefix[:, None]
        )
        buckets.append(SegmentBucket(query_index, torch.where(key_valid, key_index, 0), query_valid, key_valid))
    return buckets


def dense_mask(layout: "RowLayout") -> torch.Tensor:
    """The [R * W, R * W] mask a packed layout's segments amount to (for tests and benchmarks): entry
    [i, j] is whether position i attends to j."""
    mask = torch.zeros(layout.num_slots, layout.num_slots, dtype=torch.bool)
    for bucket in layout.segments:
        bucket = bucket.with_mask(layout.position_ids.flatten())
        for n, q in bucket.query_valid.nonzero().tolist():
            mask[bucket.query_index[n, q], bucket.key_index[n][bucket.mask[n, 0, q]]] = True
    return mask


@dataclass
class RowLayout:
    """B sequences in R rows of W positions, for one forward pass: packed (`segments` say who attends to
    whom) or padded (one sequence per row, its `attention_mask`, the model's own attention)."""

    input_ids: torch.Tensor  # [R, W] long
    position_ids: torch.Tensor  # [R, W] long: 0, 1, ... from each sequence's start (and the row's padding)
    attention_mask: torch.Tensor | None  # [R, W] when padded; None when packed
    token_index: torch.Tensor  # [B, T] long: row * W + column of each real token of each sequence
    num_real_tokens: int  # tokens that are not padding
    segments: list[SegmentBucket] | None = None  # packed: for training/segment_attention.py

    @property
    def num_slots(self) -> int:
        """R x W: the positions the forward pass computes, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> "RowLayout":
        """The layout on `device`, its segments' masks built there."""
        position_ids = self.position_ids.to(device)
        segments = (
            None if self.segments is None else [b.to(device).with_mask(position_ids.flatten()) for b in self.segments]
        )
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return RowLayout(
            self.input_ids.to(device), position_ids, mask, self.token_index.to(device), self.num_real_tokens, segments
        )


def padded_layout(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, width_multiple: int = 1) -> RowLayout:
    """One sequence per row, right-padded as they are (the unpacked reference); with `width_multiple`, to a width
    it divides (masked positions: rows cut into that many pieces for sequence or context parallelism)."""
    num_rows, length = input_ids_BT.shape
    width = -(-length // width_multiple) * width_multiple
    device = input_ids_BT.device
    return RowLayout(
        input_ids=torch.nn.functional.pad(input_ids_BT, (0, width - length)),
        position_ids=torch.arange(width, device=device).expand(num_rows, width),
        attention_mask=torch.nn.functional.pad(attention_mask_BT, (0, width - length)),
        token_index=(torch.arange(num_rows, device=device)[:, None] * width + torch.arange(length, device=device)),
        num_real_tokens=int(attention_mask_BT.sum()),
    )


def row_layout(
    input_ids_BT: torch.Tensor,
    lengths_B: list[int],
    rows: list[list[int]],
    pad_token_id: int,
    prompt_lengths_B: list[int] | None = None,
    width_multiple: int = 1,
) -> RowLayout:
    """The rows' sequences (indices into the B sequences) end to end, right-padded to the widest row (rounded up
    to a multiple of `width_multiple`: rows cut into that many pieces for sequence or context parallelism).
    With `prompt_lengths_B`, a sequence that follows one with the same prompt in its row reads that
    copy of the prompt and lays out its answer only; without, every sequence is laid out whole."""
    input_ids_BT = input_ids_BT.cpu()
    pieces_per_row: list[list[tuple[int, int]]] = []  # per row: (sequence, first token laid out) pieces
    for row in rows:
        pieces, previous = [], None
        for b in row:
            prompt = prompt_lengths_B[b] if prompt_lengths_B is not None else 0
            shares = (
                previous is not None
                and 0 < prompt < lengths_B[b]
                and prompt == prompt_lengths_B[previous]
                and torch.equal(input_ids_BT[b, :prompt], input_ids_BT[previous, :prompt])
            )
            pieces.append((b, prompt if shares else 0))
            previous = b
        pieces_per_row.append(pieces)
    width = max(sum(lengths_B[b] - first for b, first in pieces) for pieces in pieces_per_row)
    width = -(-width // width_multiple) * width_multiple
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    token_index = torch.zeros(input_ids_BT.shape, dtype=torch.long)
    segments: list[tuple[int, int, int, int]] = []  # (query start, end, prefix start, prefix end), flat positions
    for r, pieces in enumerate(pieces_per_row):
        start, owner = 0, -1  # owner: the sequence whose copy of the prompt the following samples read
        for b, first in pieces:
            end = start + lengths_B[b] - first
            input_ids[r, start:end] = input_ids_BT[b, first : lengths_B[b]]
            position_ids[r, start:end] = torch.arange(first, lengths_B[b])
            token_index[b, first : lengths_B[b]] = torch.arange(r * width + start, r * width + end)
            flat = r * width + start
            if first:  # an answer reading the prompt laid out at the start of its owner
                token_index[b, :first] = token_index[owner, :first]
                prefix = int(token_index[owner, 0])
                segments.append((flat, flat + end - start, prefix, prefix + first))
            else:  # a whole sequence: causal over itself
                owner = b
                segments.append((flat, flat + end - start, flat, flat))
            start = end
        position_ids[r, start:] = torch.arange(width - start)
    return RowLayout(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=None,
        token_index=token_index,
        num_real_tokens=sum(lengths_B),
        segments=segment_buckets(segments),
    )


# --- Which sequences share a row --------------------------------------------------------------


def prompt_keys(
    input_ids_BT: torch.Tensor, prompt_lengths_B: list[int], image_digests_B: list[bytes] | None = None
) -> list[int]:
    """One id per distinct prompt (its tokens, and its images' digests where it has images: two image prompts of the
    same text differ by their pictures): sequences with the same id have the same prompt."""
    ids: dict[bytes, int] = {}
    digests = image_digests_B or [b""] * len(prompt_lengths_B)
    return [
        ids.setdefault(input_ids_BT[b, :n].numpy().tobytes() + digests[b], len(ids))
        for b, n in enumerate(prompt_lengths_B)
    ]


def shared_prompt_rows(
    lengths: list[int], prompt_lengths: list[int], keys: list[int], max_run_tokens: int | None
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


def sequence_rows(lengths: list[int], pack: bool) -> list[list[int]]:
    """Rows of sequence indices: first-fit decreasing into rows as wide as the longest sequence (so a
    packed micro-batch is never wider than the padded one would be), or one sequence per row."""
    return first_fit_decreasing(lengths, max(lengths)) if pack else [[i] for i in range(len(lengths))]


def rows_by_token_budget(rows: list[list[int]], widths: list[int], max_batch_tokens: int) -> list[list[list[int]]]:
    """The rows (of the given widths) grouped into micro-batches whose forward computes at most
    `max_batch_tokens` positions (rows x the widest row), widest rows first, each into the micro-batch being
    filled while it fits; a row wider than the budget is a micro-batch of its own."""
    widths = [min(width, max_batch_tokens) for width in widths]
    groups: list[list[int]] = []
    for index in sorted(range(len(widths)), key=lambda i: (-widths[i], i)):
        if groups and (len(groups[-1]) + 1) * widths[groups[-1][0]] <= max_batch_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return [[rows[r] for r in group] for group in groups]
