"""Pipeline parallelism (`training.parallel.pp`): the decoder split into stages by layer, micro-batches flowing
through them by PyTorch's own schedules (`torch.distributed.pipelining`: `Schedule1F1B`, `ScheduleGPipe`).

The split (`split_stage`, in place, before tensor parallelism and FSDP2) keeps one process's module tree on every
stage: the decoder layers of other stages become parameterless `SkippedLayer`s that pass their input on, so every
parameter a stage keeps has one process's name (`model.layers.3.mlp.up_proj.weight` stays that); the first stage
keeps the embedding, the last the final norm and the heads (LM head, value or score head), the others neither.
A stage's forward is the model's own forward: a non-first stage's decoder gets the hidden states it received as
`inputs_embeds` (a pre-hook on the decoder), so masks, rotary embeddings, packed segments and sequence
parallelism are built on every stage as in one process, and the last stage's head runs unchanged.
With context parallelism a stage's decoder runs on its chunk of each row (parallel/context.py, Ulysses) and sends
only that chunk to the same cp rank of the next stage (a pp group's ranks share their cp coordinate), whose decoder
takes it as its chunk: no stage gathers whole rows, and each chunk's gradient returns the same way.

Tied input and output embeddings (`tie_word_embeddings`) become two copies, the first stage's embedding and the
last stage's LM head; their gradients are summed over the two stages before clipping (both take the same step),
and counted once in the gradient norm.

A pass (`run_pipeline`) runs this rank's micro-batches through the schedule. Micro-batches of one schedule run
must share one shape, so the hidden states sent between stages are padded to the run's largest rows x width and
cut back on arrival: the padding is never computed on. The last stage computes the head and the backend's loss
of each micro-batch with the global batch's normalisers, and the schedule sums micro-batch gradients
(`scale_grads=False`), so gradients are those of one process. Stage metadata is given explicitly per run
(static: no inference forward), so building the stage and the schedule per pass costs a one-number vote.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from reinforge.data.batch import TrainBatch
from reinforge.errors import ConfigError
from reinforge.training.micro_batching import MicroBatchPlan, micro_batch_layout, split_to
from reinforge.training.moe import model_routing
from reinforge.training.parallel.context import context_group, sequence_chunk, ulysses_forward
from reinforge.training.segment_attention import forward_layout

SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of `stage` of `pp`: contiguous runs, the earlier stages taking one more where `pp` does
    not divide `num_layers`."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class SkippedLayer(torch.nn.Module):
    """A decoder layer another stage holds: no parameters; its input passed on as its output."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        for name in ("attention_type", "layer_idx"):  # what decoders read off their layers
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class SkippedHead(torch.nn.Module):
    """A head the last stage holds: no parameters; an empty output (nothing reads it)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states.new_zeros(*hidden_states.shape[:-1], 0)


@dataclass(eq=False)
class Stage:
    """What `split_stage` left of a model: its `index` of `pp` stages, its `layers`, whether its embeddings were
    tied (then copies on the first and last stage), and the hidden states in and out of its decoder."""

    index: int
    pp: int
    layers: range
    tied: bool
    received: torch.Tensor | None = None  # the next forward's decoder input (non-first stages)
    output: torch.Tensor | None = None  # the last forward's decoder output

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.pp - 1

    def take(self) -> torch.Tensor:
        output, self.output = self.output, None
        assert output is not None, "the stage's decoder did not run"
        return output


_STAGES: "weakref.WeakKeyDictionary[torch.nn.Module, Stage]" = weakref.WeakKeyDictionary()


def pipeline_stage(model: torch.nn.Module) -> Stage | None:
    """The stage `model` was split to (`split_stage`), or None: the whole model."""
    return _STAGES.get(model)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"pipeline parallelism does not find {model.config.model_type}'s decoder layers; set training.parallel.pp=1"
        )
    return layers


def split_stage(model: torch.nn.Module, stage: int, pp: int) -> Stage:
    """Keep `stage`'s part of `model`, in place (the module docstring): foreign decoder layers `SkippedLayer`s, the
    embedding on the first stage only, the final norm and every head (the root's other children with parameters)
    on the last only; tied embeddings untied into two copies."""
    decoder, layers = model.get_decoder(), decoder_layers(model)
    kept = stage_layers(len(layers), pp, stage)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = output is not None and output.weight is embedding.weight
    info = Stage(stage, pp, kept, tied)
    for index in range(len(layers)):
        if index not in kept:
            layers[index] = SkippedLayer(layers[index])
    if stage != pp - 1:
        decoder.norm = torch.nn.Identity()
        for name, child in list(model.named_children()):
            if child is not decoder and any(True for _ in child.parameters()):
                setattr(model, name, SkippedHead())
    elif tied and stage != 0:  # the last stage's own copy of the tied weight
        output.weight = torch.nn.Parameter(embedding.weight.detach().clone(), embedding.weight.requires_grad)
    if stage != 0:
        decoder.embed_tokens = None
    decoder.register_forward_pre_hook(_receive_hook(info), with_kwargs=True)
    decoder.register_forward_hook(_catch_hook(info))
    _STAGES[model] = info
    return info


def _receive_hook(stage: Stage) -> Callable:
    """A decoder pre-hook: a non-first stage's decoder starts from the hidden states it received (`inputs_embeds`),
    not from token ids."""

    def receive(module, args, kwargs):
        if stage.received is None:
            return None
        return args, dict(kwargs, input_ids=None, inputs_embeds=stage.received)

    return receive


def _catch_hook(stage: Stage) -> Callable:
    """A decoder hook keeping its output (after the final norm on the last stage; the last layer's on the others)."""

    def catch(module, args, output):
        stage.output = output[0]

    return catch


def check_staged_moe(moe) -> None:
    """A mixture-of-experts model in stages: a one-line error for what needs every layer's routing in one place
    (router replay's per-layer routes, the auxiliary load-balancing loss over all layers); its routing metrics are
    not logged."""
    if moe.router_replay != "off" or moe.aux_loss_coef > 0:
        raise ConfigError(
            "model.moe.router_replay=rollout and model.moe.aux_loss_coef > 0 are not supported with "
            "training.parallel.pp > 1 (each stage holds only its layers' routers, and the auxiliary loss couples "
            "them all); set model.moe.router_replay=off and aux_loss_coef=0, or training.parallel.pp=1"
        )


def pad_to(hidden_RWH: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[R, W, H] padded with zeros to [rows, width, H] (differentiable: the padding's gradient is dropped)."""
    return F.pad(hidden_RWH, (0, 0, 0, width - hidden_RWH.shape[1], 0, rows - hidden_RWH.shape[0]))


# --- A pass through the schedule ---------------------------------------------------------------------


def pipeline_plan(plan: MicroBatchPlan, count: int) -> MicroBatchPlan:
    """`plan` as `count` micro-batches: its largest split (`split_to`), or consecutive ones merged."""
    if count >= len(plan):
        return split_to(plan, count)
    bounds = [len(plan) * part // count for part in range(count + 1)]
    return [[row for micro in plan[start:end] for row in micro] for start, end in zip(bounds, bounds[1:])]


class _StageModule(torch.nn.Module):
    """What the schedule runs for micro-batch `micro` on this stage: the model's forward from the received hidden
    states (cut to the micro-batch's own rows and width); the first stages return their decoder's output padded to
    the run's shape, the last returns `finish(micro)` (the micro-batch's loss, or a 0 after storing its outputs)."""

    def __init__(self, model, stage: Stage, items, config, finish: Callable[[int], torch.Tensor]):
        super().__init__()
        self.items, self.config, self.finish = items, config, finish
        self.stage, self.layouts = stage, [micro_batch_layout(micro, rows, config) for micro, rows in items]
        # context parallelism: each decoder holds its chunk of every row's columns, and passes on only that, to the
        # same cp rank of the next stage (the pp group's), whose decoder takes that chunk (parallel/context.py)
        self.group = context_group(model)
        widths = [layout.input_ids.shape[1] for layout in self.layouts]
        self.chunks = [None if self.group is None else sequence_chunk(width, self.group) for width in widths]
        self.shapes = [
            (layout.input_ids.shape[0], width if chunk is None else chunk.end - chunk.start)
            for layout, width, chunk in zip(self.layouts, widths, self.chunks)
        ]
        self.rows, self.width = (max(sizes) for sizes in zip(*self.shapes))
        object.__setattr__(self, "model", model)  # not a submodule: the schedule treats the stage as plain
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward(self, received: torch.Tensor, micro: int) -> torch.Tensor:
        rows, width = self.shapes[micro]
        self.stage.received = None if self.stage.is_first else received[:rows, :width]
        try:
            if self.stage.is_last:
                return self.finish(micro)
            batch, layout = self.items[micro][0], self.layouts[micro]
            if (routing := model_routing(self.model)) is not None:  # MoE: replay recorded routes, capture routing
                routing.prepare(batch, layout, self.chunks[micro])
            if self.group is None:
                forward_layout(self.model, layout, **self.keep)
            else:  # this rank's chunk; its attention over the whole rows
                ulysses_forward(self.model, layout, self.group, **self.keep)
            return pad_to(self.stage.take(), self.rows, self.width)
        finally:
            self.stage.received = None


def run_pipeline(
    model: torch.nn.Module,
    items: list[tuple[TrainBatch, list[list[int]]]],
    config,
    finish: Callable[[int], torch.Tensor],
    backward: bool,
    group: dist.ProcessGroup,
    device: torch.device,
    dtype: torch.dtype,
    schedule: str,
) -> None:
    """Run `items` (this rank's micro-batches and their rows, the same on every stage of its pipeline) through the
    `schedule` over the pp `group`; on the last stage `finish(i)` gives micro-batch i's loss (differentiated with
    `backward`: the schedule sums the micro-batches' gradients) or stores its outputs. Metadata is static: hidden
    states [rows, width, H] of the run's largest micro-batch, in the compute `dtype`."""
    stage = pipeline_stage(model)
    module = _StageModule(model, stage, items, config, finish)
    hidden = torch.empty(
        module.rows, module.width, model.config.get_text_config().hidden_size, dtype=dtype, device="meta"
    ).requires_grad_(backward)
    root = torch.zeros(1, device=device)  # the first stage's input: the micro-batch is named by `micro`
    loss = torch.empty((), device="meta").requires_grad_(backward)
    runner = PipelineStage(
        module,
        stage.index,
        stage.pp,
        device,
        input_args=root if stage.is_first else hidden,
        output_args=loss if stage.is_last else hidden,
        group=group,
    )
    count = len(items)
    steps = SCHEDULES[schedule](runner, count, loss_fn=_loss if backward else None, scale_grads=False)
    runner.has_backward = backward
    targets = [root] * count if backward else None
    steps._step_microbatches([(root,)] * count, [{"micro": i} for i in range(count)], targets)


def _loss(output: torch.Tensor, target) -> torch.Tensor:
    """The last stage's output is the micro-batch's loss already (the backend's, with the global normalisers)."""
    return output
