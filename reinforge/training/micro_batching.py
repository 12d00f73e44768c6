"""Micro-batches of a TrainBatch and their per-token logprobs: packing, token budgets, a chunked LM head.

Shared by the training backend (training/backend.py) and the distillation teacher. A global batch is
cut into micro-batches (`plan_micro_batches`):
`training.micro_batch_size` consecutive sequences, or, with `training.micro_batch_tokens`, rows of the
whole batch grouped to that many computed positions. With `training.sequence_packing` a micro-batch's
sequences lie end to end in rows (data/packing.py, `row_layout`; attention by segments,
training/segment_attention.py), else one right-padded sequence per row. With `training.share_prompts`
too, the samples of a prompt in a row share one copy of it, as many of them as
`training.micro_batch_tokens` allows. A micro-batch's layout is built once however many passes read it
in a step (`LayoutCache`: the old and reference logprobs, the training pass, a critic's and a teacher's).

The LM head is not applied by the model: `micro_batch_logprobs` calls it with `logits_to_keep=1`,
takes the decoder's last hidden states (`HiddenStates`), and applies the head itself, in chunks of
`training.logprob_chunk_tokens`, only where `loss_mask` is 1 (the tokens the loss trains on, and the
only logprobs a loss reads). So the [R, W, V] logits never exist, the prompt and padding positions cost
no head compute, and the result goes back to the [B, T] layout the pure loss functions take
(algorithms/losses.py), 0 off the mask. In the training pass each chunk is checkpointed: its logits are
recomputed in the backward pass instead of being kept. With `ids_BTK` (on-policy distillation's top-k
KL asks for the teacher's top-k token ids at each trained position) the same head also gives the policy's
logprobs at those ids, gathered from the same chunk of logits (one extra gather, no extra head compute).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from reinforge.data.batch import TrainBatch
from reinforge.data.images import forward_images, image_token_id
from reinforge.data.packing import (
    RowLayout,
    first_fit_decreasing,
    padded_layout,
    prompt_keys,
    row_layout,
    rows_by_token_budget,
    sequence_rows,
    shared_prompt_rows,
)
from reinforge.modeling import say_once
from reinforge.training.base import TrainingConfig
from reinforge.training.logit_transform import IDENTITY, LogitTransform, logit_transform
from reinforge.training.moe import model_routing
from reinforge.training.parallel.context import context_group, sequence_chunk, sum_over_group, ulysses_forward
from reinforge.training.parallel.layout import ParallelConfig, check_layout
from reinforge.training.parallel.tensor import is_vocab_parallel, vocab_parallel_logprobs
from reinforge.training.segment_attention import forward_layout

MicroBatchPlan = list[list[list[int]]]  # micro-batch -> rows -> indices of the batch's sequences


@dataclass
class Prompts:
    """What the planner needs to share prompts (training.share_prompts): each sequence's prompt length
    and prompt id (equal ids: equal prompts)."""

    lengths: list[int]
    keys: list[int]

    @staticmethod
    def shared(batch: TrainBatch, config: TrainingConfig) -> bool:
        """Whether the batch's prompts are shared: on, packed, and the batch knows its prompt lengths."""
        return config.share_prompts and config.sequence_packing and batch.prompt_lengths is not None

    @classmethod
    def of(cls, batch: TrainBatch, config: TrainingConfig) -> "Prompts | None":
        """None where prompts are not shared (`Prompts.shared`)."""
        if not cls.shared(batch, config):
            return None
        lengths = batch.prompt_lengths.tolist()
        digests = None if batch.images is None else [b"" if i is None else i.digest() for i in batch.images]
        return cls(lengths, prompt_keys(batch.input_ids.cpu(), lengths, digests))

    def slice(self, start: int, end: int) -> "Prompts":
        return Prompts(self.lengths[start:end], self.keys[start:end])


def model_layouts(model: torch.nn.Module, config: TrainingConfig) -> TrainingConfig:
    """`config` as `model` can lay out its rows: a model with recurrent layers (Mamba, linear attention:
    transformers' `_is_stateful`, e.g. Nemotron-H) carries its state along a row, across a packed row's sequences
    and from a shared prompt's copy to none of its answers, so it runs one sequence per row (said once); and a
    cp rank's chunk of a row would start from no state, so context parallelism is a one-line error."""
    if not getattr(model, "_is_stateful", False):
        return config
    if isinstance(config.parallel, ParallelConfig):
        check_layout(config.parallel, model.config.get_text_config(), stateful=True)
    if config.sequence_packing:
        say_once(
            f"{model.config.model_type} has recurrent layers: one sequence per row (no packing, no shared prompts)"
        )
    return config.model_copy(update={"sequence_packing": False, "share_prompts": False})


def plan_micro_batches(
    lengths: list[int], config: TrainingConfig, prompts: Prompts | None = None, row_tokens: int | None = None
) -> MicroBatchPlan:
    """Each micro-batch as rows of sequence indices (one index per row when unpacked; the samples of a
    prompt consecutive in a row where they share it). Packed rows are `row_tokens` wide, or as wide as the
    longest sequence (None, or when it is longer)."""

    def rows_of(start: int, end: int) -> tuple[list[list[int]], list[int]]:
        part = lengths[start:end]
        if prompts is not None:
            rows, widths = shared_prompt_rows(
                part, prompts.lengths[start:end], prompts.keys[start:end], config.micro_batch_tokens
            )
        else:
            if config.sequence_packing and part:
                rows = first_fit_decreasing(part, max(max(part), row_tokens or 0))
            else:
                rows = sequence_rows(part, config.sequence_packing)
            widths = [sum(part[i] for i in row) for row in rows]
        return [[start + i for i in row] for row in rows], widths

    if config.micro_batch_tokens is not None:
        return rows_by_token_budget(*rows_of(0, len(lengths)), config.micro_batch_tokens)
    return [
        rows_of(start, start + config.micro_batch_size)[0] for start in range(0, len(lengths), config.micro_batch_size)
    ]


def split_to(plan: MicroBatchPlan, count: int) -> MicroBatchPlan:
    """Split the largest micro-batches (by rows, then by sequences in a row) until there are `count`.
    FSDP2 ranks must run equally many forward passes; a plan of S sequences can always reach count <= S."""
    plan = list(plan)
    while len(plan) < count:
        index = max(range(len(plan)), key=lambda i: (len(plan[i]), max(len(row) for row in plan[i])))
        rows = plan.pop(index)
        if len(rows) > 1:
            halves = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
        else:
            row = rows[0]
            assert len(row) > 1, "cannot split a micro-batch of one sequence"
            halves = [[row[: len(row) // 2]], [row[len(row) // 2 :]]]
        plan[index:index] = halves
    return plan


def select_micro_batch(batch: TrainBatch, rows: list[list[int]]) -> tuple[TrainBatch, list[list[int]], list[int]]:
    """The micro-batch's sequences (in row order), its rows re-indexed into it, and the batch indices."""
    indices = [i for row in rows for i in row]
    local_rows, start = [], 0
    for row in rows:
        local_rows.append(list(range(start, start + len(row))))
        start += len(row)
    return batch.select(indices), local_rows, indices


class HiddenStates:
    """The last hidden states [R, W, H] of `model`'s decoder in its latest forward, caught by a forward
    hook on `model.get_decoder()`. The model itself is called (not its decoder) so that FSDP2's hooks on
    the root module run: they unshard the embeddings and the LM head, and FSDP2 does not reshard the root
    after its forward, so the head's full weight is there when `micro_batch_logprobs` applies it. `transform`:
    what the model's forward does to the logits after its head (soft-cap, scale), which the head must do too."""

    def __init__(self, model: torch.nn.Module):
        self.transform = logit_transform(model.config)  # a transform it does not know: a one-line error
        self.value: torch.Tensor | None = None
        model.get_decoder().register_forward_hook(self._catch)

    def _catch(self, module: torch.nn.Module, args, output) -> None:
        self.value = output[0]

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        assert value is not None, "the model's decoder did not run"
        return value


class LayoutCache:
    """Packed layouts by the micro-batch they lay out (its tokens, rows and shared prompts), most recent
    last, up to `max_tokens` laid-out tokens in all: a step's passes over one micro-batch build its
    layout once. Kept on the host with indices only (`RowLayout.to` builds the masks on the device for
    each pass), 39-49 bytes per token on GRPO-shaped batches (bench/layout_cache_memory.py): the default's
    8M tokens take at most about 400 MiB."""

    def __init__(self, max_tokens: int = 8_000_000):
        self.max_tokens = max_tokens
        self.layouts: OrderedDict[bytes, RowLayout] = OrderedDict()
        self.num_tokens = 0  # laid out in all the kept layouts
        self.num_built = 0

    def get(
        self,
        input_ids_BT: torch.Tensor,
        lengths: list[int],
        rows: list[list[int]],
        prompt_lengths: list[int] | None,
        width_multiple: int = 1,
    ) -> RowLayout:
        input_ids_BT = input_ids_BT.cpu()
        digest = hashlib.blake2b(input_ids_BT.numpy().tobytes(), digest_size=16)
        digest.update(repr((input_ids_BT.shape, lengths, rows, prompt_lengths, width_multiple)).encode())
        key = digest.digest()
        if key in self.layouts:
            self.layouts.move_to_end(key)
            return self.layouts[key]
        layout = self.layouts[key] = row_layout(
            input_ids_BT, lengths, rows, 0, prompt_lengths, width_multiple
        )  # the pad token is never attended to nor read
        self.num_built += 1
        self.num_tokens += layout.num_real_tokens
        while self.num_tokens > self.max_tokens and len(self.layouts) > 1:
            self.num_tokens -= self.layouts.popitem(last=False)[1].num_real_tokens
        return layout


LAYOUTS = (
    LayoutCache()
)  # one per process: the policy, its reference, a critic and a teacher read the same micro-batches


def micro_batch_layout(micro: TrainBatch, rows: list[list[int]], config: TrainingConfig) -> RowLayout:
    """The micro-batch's layout on its device: packed (prompts shared or not) or one sequence per row; its width a
    multiple of the pieces the parallel layout cuts rows into (tensor x context parallelism)."""
    multiple = config.parallel.sequence_shards if isinstance(config.parallel, ParallelConfig) else 1
    if not config.sequence_packing:
        return padded_layout(micro.input_ids, micro.attention_mask, multiple)
    prompt_lengths = micro.prompt_lengths.tolist() if Prompts.shared(micro, config) else None
    layout = LAYOUTS.get(micro.input_ids, micro.attention_mask.sum(dim=1).tolist(), rows, prompt_lengths, multiple)
    return layout.to(micro.input_ids.device)


def head_chunk(
    lm_head: torch.nn.Module,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N] of the targets under softmax(transform(lm_head(hidden)) / temperature), and the entropies [N]
    of those distributions (no gradient): the formulas of `token_logprobs` and `token_entropy` below, `transform`
    the model's own after its head (training/logit_transform.py). Targets [N, K] (several token ids per position)
    give logprobs [N, K]."""
    targets_NK = targets_N if targets_N.dim() == 2 else targets_N.unsqueeze(-1)
    if is_vocab_parallel(lm_head.weight):  # tensor parallelism: this rank's rows of the vocabulary
        logprobs_NK, entropy_N = vocab_parallel_logprobs(lm_head.weight, hidden_NH, targets_NK, temperature, transform)
    else:
        logits_NV = transform(lm_head(hidden_NH).float()) / temperature
        logsumexp_N = torch.logsumexp(logits_NV, dim=-1)
        logprobs_NK = logits_NV.gather(-1, targets_NK) - logsumexp_N.unsqueeze(-1)
        with torch.no_grad():
            logp_NV = logits_NV - logsumexp_N.unsqueeze(-1)
            entropy_N = -(logp_NV.exp() * logp_NV).sum(dim=-1)
    return (logprobs_NK if targets_N.dim() == 2 else logprobs_NK.squeeze(-1)), entropy_N


@functools.cache
def compiled_head_chunk() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`head_chunk` through `torch.compile` (training.compile): the upcast, temperature, log-sum-exp,
    gather and entropy over the [chunk, V] logits fuse into a few passes instead of one kernel each."""
    return torch.compile(head_chunk)


def chunked_head(
    lm_head: torch.nn.Module,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    compile: bool = False,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_chunk` over `chunk_tokens` tokens at a time; with gradients each chunk is checkpointed, so
    only one chunk's [chunk, V] logits exist at once in the forward and in the backward pass."""
    head = compiled_head_chunk() if compile else head_chunk
    logprobs, entropies = [], []
    # With no tokens one empty chunk still runs: the result stays connected to the model, so every
    # parameter gets a (zero) gradient, as FSDP2's reduce-scatter needs on every rank.
    for start in range(0, max(len(targets_N), 1), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (lm_head, hidden_NH[part], targets_N[part], temperature, transform)
        logprobs_N, entropy_N = checkpoint(head, *args, use_reentrant=False) if torch.is_grad_enabled() else head(*args)
        logprobs.append(logprobs_N)
        entropies.append(entropy_N)
    return torch.cat(logprobs), torch.cat(entropies)


def micro_batch_logprobs(
    model: torch.nn.Module,
    hidden: HiddenStates,
    micro: TrainBatch,
    rows: list[list[int]],
    config: TrainingConfig,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, entropy_BT) of a micro-batch, each [B, T] like `micro.loss_mask` and 0 off it;
    `rows` index the micro-batch's sequences. Differentiable when gradients are enabled."""
    logprobs_BT, entropy_BT, _ = micro_batch_logprobs_at(model, hidden, micro, rows, config, temperature, None)
    return logprobs_BT, entropy_BT


def micro_batch_logprobs_at(
    model: torch.nn.Module,
    hidden: HiddenStates,
    micro: TrainBatch,
    rows: list[list[int]],
    config: TrainingConfig,
    temperature: float,
    ids_BTK: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`micro_batch_logprobs`, and with `ids_BTK` [B, T, K] (token ids per position) the logprobs [B, T, K]
    of those ids at each position on `micro.loss_mask` (0 off it), from the same chunked head."""
    hidden_NH, targets, (b_index, t_index) = trained_hidden_states(model, hidden, micro, rows, config)
    lm_head = model.get_output_embeddings()
    if ids_BTK is not None:  # column 0 the sampled token, then the K ids
        targets = torch.cat([targets.unsqueeze(1), ids_BTK[b_index, t_index]], dim=1)
    logprobs, entropy_N = chunked_head(
        lm_head, hidden_NH, targets, temperature, config.logprob_chunk_tokens, config.compile, hidden.transform
    )
    shape = micro.loss_mask.shape
    logprobs_BT = hidden_NH.new_zeros(shape, dtype=torch.float32).index_put(
        (b_index, t_index), logprobs if ids_BTK is None else logprobs[:, 0]
    )
    entropy_BT = torch.zeros(shape, device=micro.loss_mask.device).index_put((b_index, t_index), entropy_N)
    logprobs_BT, entropy_BT = combine_context(model, logprobs_BT), combine_context(model, entropy_BT)
    if ids_BTK is None:
        return logprobs_BT, entropy_BT, None
    at_ids_BTK = hidden_NH.new_zeros(ids_BTK.shape, dtype=torch.float32).index_put((b_index, t_index), logprobs[:, 1:])
    return logprobs_BT, entropy_BT, combine_context(model, at_ids_BTK)


def combine_context(model: torch.nn.Module, outputs: torch.Tensor) -> torch.Tensor:
    """Per-token outputs of this rank's tokens (0 elsewhere) summed over the model's cp group, so every rank holds
    all of them and computes the same loss (training/parallel/context.py, `sum_over_group`); as they are without one."""
    group = context_group(model)
    return outputs if group is None else sum_over_group(outputs, group)


def trained_hidden_states(
    model: torch.nn.Module,
    hidden: HiddenStates,
    micro: TrainBatch,
    rows: list[list[int]],
    config: TrainingConfig,
    shift: int = 1,
    logits_to_keep: int | None = 1,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The decoder's hidden states [N, H] at the N tokens on `micro.loss_mask` moved back by `shift` (1: the
    states that predict them; 0: their own), in the micro-batch's packed, prompt-sharing or padded layout;
    those tokens' ids [N]; and their (row, column) indices in the micro-batch. With context parallelism
    (`context_group`) the tokens whose states this rank's chunk of columns holds only: callers sum their outputs
    over the group (`combine_context`); a vision-language model's images are merged into the whole rows on every
    rank before its decoder takes the chunk (context.py's `ulysses_forward`). `logits_to_keep` goes to the
    model (1: a causal LM's head on one position per row; None: a model without that argument)."""
    layout = micro_batch_layout(micro, rows, config)
    group = context_group(model)
    if (routing := model_routing(model)) is not None:  # MoE: replay recorded routes, capture the routing
        routing.prepare(micro, layout, None if group is None else sequence_chunk(layout.input_ids.shape[1], group))
    # with logits_to_keep=1 the LM head runs on one position per row: `hidden` has what the head needs
    kwargs = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    images = {}
    if micro.images is not None:  # a vision-language model: each prompt's images once, in the layout's order
        images = forward_images(
            micro.images,
            micro.input_ids,
            layout.token_index,
            image_token_id(model.config),
            model.config.model_type,
            layout.input_ids.device,
        )
    b_index, t_index = micro.loss_mask.nonzero(as_tuple=True)
    assert bool((t_index >= shift).all()), "column 0 is in the loss mask"
    flat = layout.token_index[b_index, t_index]  # where each trained token sits in the layout
    # with shift 1, token t is predicted from the hidden state of token t - 1 of the same sequence (t > 0)
    source = layout.token_index[b_index, t_index - shift]
    if group is None:
        forward_layout(model, layout, **kwargs, **images)
        return hidden.take().flatten(0, 1)[source], layout.input_ids.flatten()[flat], (b_index, t_index)
    # context parallelism: this rank's chunk of columns only, and the trained tokens whose state it holds
    ulysses_forward(model, layout, group, images, **kwargs)
    hidden_RCH, width = hidden.take(), layout.input_ids.shape[1]
    chunk = sequence_chunk(width, group)
    row, column = source // width, source % width
    here = (column >= chunk.start) & (column < chunk.end)
    hidden_NH = hidden_RCH[row[here], column[here] - chunk.start]
    return hidden_NH, layout.input_ids.flatten()[flat[here]], (b_index[here], t_index[here])


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """The reference formula over whole logits: logprobs_BT[b, t] = log softmax(logits[b, t-1] / temperature)
    [input_ids[b, t]]; column 0 is 0."""
    logits_BTV = logits_BTV[:, :-1].float() / temperature
    targets_BT = input_ids_BT[:, 1:]
    picked_BT = logits_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    return F.pad(picked_BT - torch.logsumexp(logits_BTV, dim=-1), (1, 0))


def token_entropy(logits_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the next-token distribution that produced each token, aligned like `token_logprobs`."""
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    return F.pad(-(logp_BTV.exp() * logp_BTV).sum(dim=-1), (1, 0))
