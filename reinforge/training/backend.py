"""The training backend: a model, its head, an optimizer and a parallelism strategy, for every recipe.

One class trains the GRPO/PPO/distillation policy, PPO's critic, SFT, DPO and the reward model. What differs
between them is composed, not subclassed:

- the head (training/heads.py) says how the model is loaded and what it gives per trained token: the
  policy's logprobs from a chunked LM head (`LogprobHead`), or a scalar from a linear head on the hidden
  states (`ScalarHead`: PPO's value head, the reward model's score head);
- the strategy says where the model runs: this process (`LocalStrategy`, training/strategy.py) or one rank
  of N FSDP2 ranks (`FSDP2Strategy`, training/fsdp2.py), with its share of each batch's micro-batches, the
  assembly (or gather over ranks) of per-token outputs, gradient clipping by the global norm, metric
  reduction, sharded checkpoints and full weights for refit;
- the loss is a pure function of the head's per-token outputs, the micro-batch and the global batch's
  normalisers (`LossFn`); a loss that needs more outputs declares them (`Loss` with `LogprobsAt`: the
  policy's logprobs at the token ids of a named batch field, e.g. distillation's teacher top-k ids), so
  the backend never knows which recipe it trains.

Gradients accumulate over micro-batches with the loss function's global normaliser, so one optimizer step
sees the gradient of the whole global batch (micro-batches and ranks sum to one big batch). Micro-batches
are planned by training/micro_batching.py (`training.micro_batch_size` sequences or
`training.micro_batch_tokens` positions, packed or not, prompts shared or not); AdamW and its schedule come
from training/optimizer.py. No non-finite loss, gradient or parameter reaches AdamW, a checkpoint or an export: each
step is checked and skipped, or the run stopped (training/numerics.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Iterator

import torch

from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.modeling import (
    compile_decoder_layers,
    enable_activation_checkpointing,
    freeze_vision_tower,
    is_moe,
    load_model,
    moe_routers,
)
from reinforge.training.base import LossFn, TrainingConfig
from reinforge.training.heads import Head, LogprobHead, Loss
from reinforge.training.lora import adapter_disabled, merge_lora_weights, scaling
from reinforge.training.micro_batching import HiddenStates, MicroBatchPlan, model_layouts, plan_micro_batches
from reinforge.training.moe import MoeRouting, RoutedTokens, clear_routing, forward_metrics, model_routing
from reinforge.training.numerics import (
    NonfiniteSteps,
    ParameterNames,
    fault_step,
    gradient_code,
    local,
    nonfinite_parameter,
    parameter_error,
    reduced_checks,
    state_error,
    step_fault,
    warn,
)
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig, build_optimizer, clip_norm
from reinforge.training.parallel.context import context_group
from reinforge.training.strategy import LocalStrategy, Strategy


def accumulate_metrics(
    totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]
) -> None:
    """Add one micro-batch's metric contributions: sums, and max/min for `*_max`/`*_min`."""
    for name, value in metrics.items():
        value = value.detach().float()
        if name.endswith(("_max", "_min")):
            reduce = torch.maximum if name.endswith("_max") else torch.minimum
            extremes[name] = reduce(extremes[name], value) if name in extremes else value
        else:
            totals[name] = totals[name] + value


class Backend:
    """A trained model (and optionally its frozen reference), AdamW and its schedule, on a strategy.

    With `model.lora` (and an LM head) the model is the base with PEFT's adapters, the only parameters trained,
    and the reference is the same model with the adapters disabled (training/lora.py)."""

    def __init__(
        self,
        model_config: ModelConfig,
        training: TrainingConfig,
        optimizer: OptimizerConfig,
        scheduler: SchedulerConfig,
        num_optimizer_steps: int,
        head: Head | None = None,
        strategy: Strategy | None = None,
        load_reference: bool = False,
        row_tokens: int | None = None,
        nonfinite_fault_at: int | None = None,
    ):
        """`head`: an LM head at temperature 1 by default. `strategy`: this process by default (an
        `FSDP2Strategy` is set up here, in the rank's process). `row_tokens`: the width of a packed row (SFT packs
        conversations into rows of `data.max_seq_len`); None: the micro-batch's longest sequence.
        `nonfinite_fault_at`: the testing hook's step (training/numerics.py), by default this process's
        REINFORGE_FAULT_NONFINITE_AT_STEP."""
        self.lora = model_config.lora
        self.head = head or LogprobHead(temperature=1.0)
        self.strategy = strategy or LocalStrategy()
        self.config = training = self.strategy.setup(training)  # its `parallel` layout resolved
        self.row_tokens = row_tokens
        load_config = self.strategy.load_config(model_config)
        model, self.peft = self.head.load(load_config)
        # a recurrent model: one sequence per row, in the plans of the strategy (which reads its prompt sharing) too
        self.config = self.strategy.config = model_layouts(model, self.config)
        if model_config.freeze_vision and self.peft is None:
            freeze_vision_tower(model)  # a vision-language model's encoder keeps its weights (docs/vlm.md)
        if training.activation_checkpointing:
            enable_activation_checkpointing(model)  # before sharding: FSDP2 wraps the checkpointed layers
        if training.compile:
            compile_decoder_layers(model)
        self.model = self.strategy.prepare(model).train()
        self.reference = None
        if load_reference and self.peft is None:
            reference = load_model(load_config).requires_grad_(False)
            if training.compile:
                compile_decoder_layers(reference)
            self.reference = self.strategy.prepare(reference).eval()
        self.hidden = {id(m): HiddenStates(m) for m in (self.model, self.reference) if m is not None}
        self.moe = model_config.moe
        replay = self.moe.router_replay == "rollout"
        whole = is_moe(self.model.config) and not self.strategy.pipelined  # a pipeline stage has some layers' routers
        if whole and (replay or moe_routers(self.model)):  # router replay, metrics: training/moe.py
            MoeRouting(self.model, replay)
            if replay and self.reference is not None:  # the reference's logprobs on the same routes
                MoeRouting(self.reference, replay)
        trained = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.trainable_names, self.trainable = [name for name, _ in trained], [p for _, p in trained]
        self.nonfinite = NonfiniteSteps(training.max_nonfinite_steps)
        self.names = ParameterNames.of(self.strategy, self.model, self.trainable_names)  # numerics' names
        self.fault_at = fault_step() if nonfinite_fault_at is None else nonfinite_fault_at
        self.role = "the critic's training" if getattr(self.head, "module", None) == "value_head" else "training"
        self.versions: dict[int, list[torch.Tensor]] = {}  # keep_version's copies
        self.pending_losses: list[torch.Tensor] = []  # loss_pass's, checked at the next adam_step
        self.optimizer_config = optimizer
        self.optimizer, self.scheduler = build_optimizer(self.trainable, optimizer, scheduler, num_optimizer_steps)

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    def plan(self, lengths: list[int], prompts) -> MicroBatchPlan:
        """The micro-batches of sequences of these lengths (training/micro_batching.py)."""
        return plan_micro_batches(lengths, self.config, prompts, self.row_tokens)

    def num_parameters(self) -> tuple[int, int]:
        """(the model's parameters, the trained ones), whole-model counts on any rank (a sharded parameter, a
        DTensor, counts its full shape)."""
        return self.strategy.count_parameters(self.model, self.trainable)  # every stage's at pp > 1

    # --- per-token passes ----------------------------------------------------------------------

    @torch.no_grad()
    def per_token(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """The head's outputs [B, T] on `batch.loss_mask` (0 off it), without gradients: the policy's logprobs
        (or its reference's: the frozen copy, or with LoRA the policy with its adapters disabled), or values."""
        model = self.reference if reference and self.peft is None else self.model
        assert model is not None, "the reference policy was not loaded (loss.kl_coef is 0)"
        try:
            with adapter_disabled(self.peft if reference else None):
                return self.strategy.per_token(batch, self.plan, partial(self._outputs, model), model)
        finally:
            clear_routing(model)

    def logprobs(self, batch: TrainBatch, reference: bool = False, version: int | None = None) -> torch.Tensor:
        """`per_token` of a backend with an LM head: per-token logprobs [B, T], 0 off `batch.loss_mask`; `version`:
        under the trained parameters `keep_version` kept as that policy version."""
        if version is None:
            return self.per_token(batch, reference)
        current = [local(p).detach().clone() for p in self.trainable]
        with torch.no_grad():
            try:
                for param, kept in zip(self.trainable, self.versions[version]):
                    local(param).copy_(kept)
                return self.per_token(batch)
            finally:
                for param, value in zip(self.trainable, current):
                    local(param).copy_(value)

    def keep_version(self, version: int, depth: int) -> list[int]:
        """Keep a CPU copy of the trained parameters (this rank's shards) as policy `version`, and only the last
        `depth` versions; returns the versions kept (rollout.version_check)."""
        self.versions[version] = [local(p).detach().to("cpu", copy=True) for p in self.trainable]
        for old in sorted(self.versions)[:-depth]:
            del self.versions[old]
        return sorted(self.versions)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """`per_token` of a backend with a scalar head (PPO's critic): V(s_t) [B, T], 0 off `batch.loss_mask`."""
        return self.per_token(batch)

    def _outputs(self, model: torch.nn.Module, micro: TrainBatch, rows: list[list[int]]) -> torch.Tensor:
        return self.head.forward(model, self.hidden[id(model)], micro, rows, self.config, ())[0]

    # --- training ------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_fn: LossFn | Loss, step: int | None = None) -> dict[str, float]:
        """One optimizer step on a global batch: accumulate, clip by the global norm, step, advance the schedule;
        skipped when its loss or gradient norm is not finite (training/numerics.py). `step`: the loop's step, which
        messages name (by default this backend's count of optimizer steps)."""
        metrics, note = self.checked_step(batch, loss_fn, step)
        if note:
            warn(note)
        return metrics

    def checked_step(
        self, batch: TrainBatch, loss_fn: LossFn | Loss, step: int | None = None
    ) -> tuple[dict[str, float], str | None]:
        """`train_step`, with the line that says a non-finite step was skipped (None: it was not) returned for the
        caller to show (an FSDP2 rank's output is not the console)."""
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        metrics = self._passes(batch, Loss.of(loss_fn), backward=True, losses=losses)
        step_metrics, note = self._apply_gradients(step, losses, clip_norm(self.optimizer_config))
        return {**metrics, **step_metrics}, note

    def loss_pass(self, batch: TrainBatch, loss_fn: LossFn | Loss, backward: bool) -> tuple[dict[str, float], list]:
        """`loss_fn` over `batch` for a caller that steps itself (`adam_step`): with `backward` its gradient adds to
        `.grad` (Tinker's forward_backward calls add up until optim_step), its losses kept for the step's checks;
        else in eval mode without gradients. The metrics, and `loss_fn` as each rank left it (a loss that records
        outputs hands them back so)."""
        if backward:
            metrics = self._passes(batch, Loss.of(loss_fn), backward=True, losses=self.pending_losses)
        else:
            metrics = self.evaluate(batch, loss_fn)
        return metrics, self.strategy.gather_objects(loss_fn)

    def adam_step(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, max_grad_norm: float
    ) -> tuple[dict[str, float], str | None]:
        """AdamW on the gradients `loss_pass` accumulated, with these settings in every parameter group (no schedule:
        a Tinker client sends its learning rate each step), clipped to `max_grad_norm` (0: not clipped); checked and
        skipped as `checked_step` is, the gradients zeroed after."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        losses, self.pending_losses = self.pending_losses, []
        return self._apply_gradients(None, losses, max_grad_norm if max_grad_norm > 0 else float("inf"), False)

    def _apply_gradients(
        self, step: int | None, losses: list[torch.Tensor], max_norm: float, schedule: bool = True
    ) -> tuple[dict[str, float], str | None]:
        """Clip, check, step (and advance the schedule with `schedule`) on the accumulated gradients, then free them."""
        step = self.nonfinite.begin(step)
        if step == self.fault_at:  # the testing hook: this step's gradients are NaN
            for grad in (p.grad for p in self.trainable if p.grad is not None):
                local(grad).fill_(float("nan"))
        gradient = gradient_code(self.trainable, self.names.codes)  # before clipping spreads a NaN to every gradient
        grad_norm = self.strategy.clip_gradients(self.trainable, max_norm)
        metrics = dict(grad_norm=float(grad_norm), lr=self.optimizer.param_groups[0]["lr"])
        note = self._skip_note(step, losses, gradient, grad_norm)
        if note is None:
            self.optimizer.step()
            if schedule:
                self.scheduler.step()
            self.nonfinite.finite()
            if (bad := self._first_nonfinite()) is not None:
                raise parameter_error(step, bad, self.role)
        # freed now, not at the next step: a colocated engine generates in their memory (planner.py, PERSISTENT)
        self.optimizer.zero_grad(set_to_none=True)
        return {**metrics, "nonfinite_steps": float(self.nonfinite.skipped)}, note

    def _skip_note(self, step: int, losses: list[torch.Tensor], gradient: torch.Tensor, grad_norm) -> str | None:
        """Whether this step is skipped, decided alike on every rank: the line that says so (None: it is not), or a
        `NumericalError` at `training.max_nonfinite_steps` in a row."""
        loss, first_gradient, norm_finite = reduced_checks(self.strategy, losses, gradient, grad_norm)
        if (fault := step_fault(loss, norm_finite, self.strategy.world_size, self.names.name(first_gradient))) is None:
            return None
        return self.nonfinite.skip(step, fault, self.role)

    def _first_nonfinite(self, moments: bool = False) -> str | None:
        """The first trained parameter that is not finite (or too large; with `moments`, or whose AdamW moments are
        not finite) on some rank; None when all are (a collective on FSDP2 ranks)."""
        optimizer = self.optimizer if moments else None
        return nonfinite_parameter(self.strategy, self.names, self.trainable, optimizer)

    def accumulate_gradients(self, batch: TrainBatch, loss_fn: LossFn | Loss) -> dict[str, float]:
        """Add the gradient of the global-batch loss to `.grad`, one micro-batch at a time; the batch's metrics."""
        return self._passes(batch, Loss.of(loss_fn), backward=True)

    @torch.no_grad()
    def evaluate(self, batch: TrainBatch, loss_fn: LossFn | Loss) -> dict[str, float]:
        """The loss function's metrics over a batch in eval mode, without gradients (validation)."""
        self.model.eval()
        try:
            return self._passes(batch, Loss.of(loss_fn), backward=False)
        finally:
            self.model.train()

    def _passes(
        self, batch: TrainBatch, loss: Loss, backward: bool, losses: list[torch.Tensor] | None = None
    ) -> dict[str, float]:
        """`losses`: each micro-batch's loss appended (detached)."""
        norm = batch.normalisers()
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.tensor(0.0, device=self.device))
        extremes: dict[str, torch.Tensor] = {}
        routed = RoutedTokens.of(batch) if model_routing(self.model) is not None else None

        def micro_loss(indices, micro: TrainBatch, rows: list[list[int]]) -> torch.Tensor:
            value, metrics = self._micro_loss(micro, rows, loss, norm, routed, losses)
            accumulate_metrics(totals, extremes, metrics)
            return value

        try:  # each micro-batch's loss (and backward): one after another, or through a pipeline's stages
            self.strategy.passes(self.model, batch, self.plan, micro_loss, backward)
        finally:
            clear_routing(self.model)
        return self.strategy.reduce_metrics(totals, extremes)

    def _micro_loss(
        self,
        micro: TrainBatch,
        rows: list[list[int]],
        loss: Loss,
        norm: Normalisers,
        routed: RoutedTokens | None = None,
        losses: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and loss of one micro-batch; the loss, and its detached metric contributions, summable over
        micro-batches like the loss, with the head's per-token diagnostics (the policy's entropy) as token means.
        An MoE model's routing metrics (`routed`: the batch's token counts) come with them, and its auxiliary
        load-balancing loss joins the loss with weight `model.moe.aux_loss_coef`."""
        outputs_BT, micro, diagnostics = self.head.forward(
            self.model, self.hidden[id(self.model)], micro, rows, self.config, loss.logprobs_at
        )
        value, metrics = loss(outputs_BT, micro, norm)
        if (routing := model_routing(self.model)) is not None:
            moe_metrics = forward_metrics(routing.statistics(context_group(self.model)), routed, routing.replay)
            if self.moe.aux_loss_coef > 0:
                value = value + self.moe.aux_loss_coef * moe_metrics["moe/aux_loss"]
            metrics.update(moe_metrics)
        if losses is not None:
            losses.append(value.detach())
        mask, num_tokens = micro.loss_mask, max(norm.metric_tokens, 1)
        metrics.update({name: (d_BT * mask).sum() / num_tokens for name, d_BT in diagnostics.items()})
        return value, {name: v.detach() for name, v in metrics.items()}

    # --- weights and state ---------------------------------------------------------------------

    @torch.no_grad()
    def named_weights(self, part: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's full weights with Hugging Face names (a collective on FSDP2 ranks: all must iterate); with
        LoRA the merged weights, W + (alpha / r) B A, the base left as it is. Tied parameters (lm_head and
        embed_tokens) appear under both names as one tensor object, so `save_pretrained` writes the tie once.
        `part`: only the weights of `weight_parts()[part]` (one decoder layer, or what is outside the layers)."""
        names = None if part is None else self.weight_parts()[part]
        weights = self.strategy.full_state_dict(self.model, names)
        yield from (merge_lora_weights(weights, scaling(self.lora)) if self.peft is not None else weights).items()

    def weight_parts(self) -> list[list[str]]:
        """The model's state-dict names by decoder layer (what is outside the layers first): the pieces a refit
        gathers one at a time, so no rank holds more than one layer's full weights beside its shards."""
        if not hasattr(self, "_weight_parts"):
            parts: dict[int, list[str]] = {}
            for name in self.strategy.state_names(self.model):  # every stage's at pp > 1
                layer = re.search(r"\.layers\.(\d+)\.", name)
                parts.setdefault(int(layer.group(1)) if layer else -1, []).append(name)
            self._weight_parts = [parts[key] for key in sorted(parts)]
        return self._weight_parts

    def num_weight_parts(self) -> int:
        return len(self.weight_parts())

    def full_state(self, part: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """`named_weights(part)` as a list on the main rank (empty elsewhere): what a remote caller fetches for
        refit, one part at a time."""
        weights = list(self.named_weights(part))
        return weights if self.strategy.is_main else []

    def host_weight_transfer(self, world_size: int, timeout_s: float) -> int | None:
        """The main rank hosts the refit's transfer group (generation/weight_transfer.py) on a free port, returned;
        the other ranks have no part in the group: they only gather the weights with it."""
        if not self.strategy.is_main:
            return None
        from reinforge.generation.weight_transfer import Sender

        self.sender = Sender()
        return self.sender.host(world_size, timeout_s)

    def join_weight_transfer(self) -> None:
        """Returns once every engine worker has joined the group the main rank hosts."""
        if self.strategy.is_main:
            self.sender.join()

    def send_weights(self, layout, bucket_bytes: int, expect=None):
        """Send the full weights to every engine, a decoder layer at a time (a collective: every rank gathers each
        layer; the main rank sends it while the next is gathered), as `layout` (the engines' `WireLayout`) says.
        The main rank's `SendStats` as a dict, with
        `expectation`: `expect` (a refit check's `Expectation`, generation/weight_digest.py) given each layer as
        it is sent."""
        parts = (list(self.named_weights(part)) for part in range(self.num_weight_parts()))
        if not self.strategy.is_main:
            for _ in parts:  # gather each layer with the main rank, which alone sends it
                pass
            return None
        stats = self.sender.send(parts, layout, bucket_bytes, expect.add if expect else None)
        return {**vars(stats), "expectation": expect}

    def save_pretrained(self, path: Path) -> None:
        """The model as a Hugging Face directory, written by the main rank; with LoRA, its adapter in PEFT's format.
        Never with a non-finite trained weight (a one-line `NumericalError` instead)."""
        if self.peft is not None:
            return self.save_adapter(path)
        self._check_finite(f"the model {path}")
        self.strategy.save_pretrained(self.model, Path(path))

    def save_adapter(self, path: Path) -> None:
        """The LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)."""
        self._check_finite(f"the adapter {path}")
        self.strategy.save_adapter(self.model, self.peft, Path(path))

    def save_state(self, path: Path) -> None:
        """Everything an exact resume needs: the model's weights (with LoRA, the adapter's only), AdamW state and
        the LR schedule's position, and the non-finite step counters with the checkpoint's `finite` mark
        (numerics.json); a state with a non-finite weight or moment is never written."""
        self._check_finite(f"the checkpoint {path}", moments=True)
        self.strategy.save_state(self.model, self.optimizer, self.scheduler, Path(path), self.peft is not None)
        if self.strategy.is_main:
            self.nonfinite.save(Path(path))

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote (same model, same optimizer settings)."""
        self.strategy.load_state(self.model, self.optimizer, self.scheduler, Path(path), self.peft is not None)
        self.nonfinite.load(Path(path))

    def _check_finite(self, what: str, moments: bool = False) -> None:
        if (bad := self._first_nonfinite(moments=moments)) is not None:
            raise state_error(f"the parameter {bad}" + (" (or its AdamW moments)" if moments else ""), what)

    def memory(self) -> dict[str, float]:
        """This process's peak host (and GPU) memory, GiB."""
        from reinforge.logging.memory import memory_metrics

        return memory_metrics(prefix="")

    def memory_metrics(self) -> dict[str, float]:
        """What the loop logs of the trainer's memory beside the driver's own: nothing for a backend in the driver's
        process (the driver's metrics are its); a Ray group of ranks gives each rank's (cluster/fsdp2_trainer.py)."""
        return {}

    def shutdown(self) -> None:
        self.strategy.shutdown()
