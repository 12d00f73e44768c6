"""Single-process PyTorch training backend (`training.backend=torch`).

The policy is an ordinary Hugging Face causal LM; AdamW with a warm-up schedule from transformers;
gradients accumulate over micro-batches with the loss function's global normaliser, so one optimizer
step sees the gradient of the whole global batch. Micro-batches are packed (or not) and sized in
sequences or tokens as `training.sequence_packing` and `training.micro_batch_tokens` say, and logprobs
come from a chunked LM head on the trained tokens only (training/micro_batching.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from transformers import get_scheduler

from reinforge.algorithms.losses import Normalisers, metric_mean
from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.data.batch import TrainBatch
from reinforge.modeling import compile_decoder_layers, enable_activation_checkpointing, load_model
from reinforge.training.base import LossFn
from reinforge.training.lora import (
    adapter_disabled,
    adapter_state_dict,
    load_adapter_state_dict,
    load_policy,
    merge_lora_weights,
    scaling,
)
from reinforge.training.micro_batching import (
    HiddenStates,
    Prompts,
    micro_batch_logprobs,
    micro_batch_logprobs_at,
    plan_micro_batches,
    select_micro_batch,
)

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], config: TrainingConfig, num_optimizer_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its warm-up + schedule over the run's optimizer steps (shared by every backend)."""
    optimizer = torch.optim.AdamW(
        parameters,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    scheduler = get_scheduler(
        SCHEDULES[config.lr_schedule],
        optimizer,
        num_warmup_steps=config.warmup_steps,
        num_training_steps=max(num_optimizer_steps, 1),
    )
    return optimizer, scheduler


def backward_micro_batch(
    model: torch.nn.Module,
    hidden: HiddenStates,
    micro: TrainBatch,
    rows: list[list[int]],
    loss_fn: LossFn,
    norm: Normalisers,
    config: TrainingConfig,
    temperature: float,
) -> dict[str, torch.Tensor]:
    """Forward, loss and backward of one micro-batch (`rows` index its sequences); returns its detached
    metric contributions (summable over micro-batches, like the loss), the policy's entropy included.
    The loss function sees logprobs on `micro.loss_mask` and 0 elsewhere."""
    logprobs_BT, entropy_BT, topk_BTK = micro_batch_logprobs_at(
        model, hidden, micro, rows, config, temperature, micro.teacher_topk_ids
    )
    if topk_BTK is not None:  # on-policy distillation's top-k KL reads the policy's logprobs at the teacher's ids
        micro = replace(micro, topk_logprobs=topk_BTK)
    loss, metrics = loss_fn(logprobs_BT, micro, norm)
    loss.backward()
    metrics["entropy"] = metric_mean(entropy_BT, micro.loss_mask, norm)
    return {name: value.detach() for name, value in metrics.items()}


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


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """logprobs_BT[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]; column 0 is 0."""
    logits_BTV = logits_BTV[:, :-1].float() / temperature
    targets_BT = input_ids_BT[:, 1:]
    picked_BT = logits_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    logprobs_BT = picked_BT - torch.logsumexp(logits_BTV, dim=-1)
    return F.pad(logprobs_BT, (1, 0))


def token_entropy(logits_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the next-token distribution that produced each token, aligned like `token_logprobs`."""
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
    return F.pad(entropy_BT, (1, 0))


class PolicyPasses:
    """The passes both training backends run alike over their micro-batches: each backend has its own
    `_micro_batches` (this process's, or one rank's share), `_per_token` (assembling [B, T] here, or
    gathering it from every rank), `_clip_gradients` and `_reduce_metrics` (over the ranks), and a `model`,
    `reference`, `peft`, `hidden`, `optimizer`, `scheduler`, `device`, `config` and `temperature`."""

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [B, T] of the policy (or its reference: the frozen copy, or with LoRA the
        policy with its adapters disabled), 0 off `batch.loss_mask`."""
        model = self.reference if reference and self.peft is None else self.model
        assert model is not None, "the reference policy was not loaded (loss.kl_coef is 0)"
        with adapter_disabled(self.peft if reference else None):
            return self._per_token(
                batch,
                lambda micro, rows: micro_batch_logprobs(
                    model, self.hidden[id(model)], micro, rows, self.config, self.temperature
                )[0],
            )

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on a global batch: accumulate, clip by the global norm, step, advance the schedule."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(batch, loss_fn)
        grad_norm = self._clip_gradients(self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf"))
        metrics.update(grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def accumulate_gradients(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """Add the gradient of the global-batch loss to `.grad`, one micro-batch at a time; the batch's metrics."""
        norm = batch.normalisers()
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.tensor(0.0, device=self.device))
        extremes: dict[str, torch.Tensor] = {}
        for _, micro, rows in self._micro_batches(batch):
            accumulate_metrics(totals, extremes, self._backward(micro, rows, loss_fn, norm))
        return self._reduce_metrics(totals, extremes)

    def _backward(
        self, micro: TrainBatch, rows: list[list[int]], loss_fn: LossFn, norm: Normalisers
    ) -> dict[str, torch.Tensor]:
        """Forward, loss and backward of one micro-batch; its summable metric contributions."""
        return backward_micro_batch(
            self.model, self.hidden[id(self.model)], micro, rows, loss_fn, norm, self.config, self.temperature
        )


class TorchBackend(PolicyPasses):
    """Policy (+ optional frozen reference), AdamW and its schedule, in this process. With `model.lora`
    the policy is the base model with PEFT's adapters, the only parameters trained, and the reference
    is the same model with the adapters disabled (training/lora.py)."""

    def __init__(
        self,
        model_config: ModelConfig,
        training_config: TrainingConfig,
        temperature: float,
        num_optimizer_steps: int,
        load_reference: bool,
    ):
        self.config, self.lora = training_config, model_config.lora
        self.temperature = temperature
        self.model, self.peft = self._load_trained_model(model_config)
        if training_config.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self.model.train()
        self.reference = None
        if load_reference and self.peft is None:
            self.reference = load_model(model_config).eval().requires_grad_(False)
        if training_config.compile:
            for model in (self.model, self.reference):
                if model is not None:
                    compile_decoder_layers(model)
        self.hidden = {id(m): HiddenStates(m) for m in (self.model, self.reference) if m is not None}
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.trainable, training_config, num_optimizer_steps)

    def _load_trained_model(self, model_config: ModelConfig):
        """(the model to train, its PeftModel or None); a subclass adds modules here (the critic's value head)."""
        return load_policy(model_config)

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[list[int], TrainBatch, list[list[int]]]]:
        """(batch indices, micro-batch, its rows) for every micro-batch of the batch."""
        prompts = Prompts.of(batch, self.config)
        for rows in plan_micro_batches(batch.attention_mask.sum(dim=1).tolist(), self.config, prompts):
            micro, local_rows, indices = select_micro_batch(batch, rows)
            yield indices, micro, local_rows

    def _per_token(
        self, batch: TrainBatch, compute: Callable[[TrainBatch, list[list[int]]], torch.Tensor]
    ) -> torch.Tensor:
        """`compute(micro, rows)` ([b, t] per micro-batch) assembled into [B, T], 0 off `batch.loss_mask`."""
        out = torch.zeros_like(batch.loss_mask)
        for indices, micro, rows in self._micro_batches(batch):
            values_BT = compute(micro, rows)
            out[indices, : values_BT.shape[1]] = values_BT
        return out * batch.loss_mask

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)

    def _reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        return {name: float(value) for name, value in (totals | extremes).items()}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's Hugging Face weights (with LoRA: merged, W + (alpha / r) B A, the base left as it is)."""
        state = self.model.state_dict()
        yield from (merge_lora_weights(state, scaling(self.lora)) if self.peft is not None else state).items()

    def save_adapter(self, path: Path) -> None:
        """The LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)."""
        self.peft.save_pretrained(path)

    def save_pretrained(self, path: Path) -> None:
        """The policy as a Hugging Face directory; with LoRA, its adapter in PEFT's format."""
        (self.peft or self.model).save_pretrained(path)

    def save_state(self, path: Path) -> None:
        """Policy weights (with LoRA, the adapter's only), AdamW state and the LR schedule's position, for an exact resume."""
        path.mkdir(parents=True, exist_ok=True)
        weights = adapter_state_dict(self.model) if self.peft is not None else self.model.state_dict()
        state = {"model": weights, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save(state, path / "state.pt")

    def load_state(self, path: Path) -> None:
        state = torch.load(path / "state.pt", weights_only=False)
        if self.peft is not None:
            load_adapter_state_dict(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
