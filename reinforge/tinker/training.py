"""The training side of the Tinker service: forward_backward / forward / optim_step on reinforge's training backend.

A Tinker datum says that position i of its tokens predicts `target_tokens[i]`, whatever id that is (the SDK's
loops put 0 on prompt positions, with weight 0). In reinforge's batch convention column t's logprob is that of
`input_ids[t]` given the columns before it, so a datum of N tokens becomes a row of N + 1 columns: its tokens and
one more, the loss mask on columns 1..N, and its targets in an ids field [B, T, K] read through `LogprobsAt`, so the
logprobs at the targets come out of the training pass itself (one forward, with gradients). The loss
(tinker/losses.py) runs per datum in the micro-batches the backend plans, and records each datum's outputs under
its index, which come back from every rank (`Backend.loss_pass`) and are returned in request order.

Tinker's semantics: forward_backward adds its gradient to what the earlier calls left (two calls then one
optim_step step on the gradient of the sum); optim_step applies AdamW with the request's parameters (decoupled
weight decay, clipping by `grad_clip_norm` when > 0), with the backend's non-finite checks, and zeroes the
gradients. There is no schedule: the client sends its learning rate with every step.

On FSDP2 ranks (`training.backend=fsdp2`) every rank gets the whole batch and trains its contiguous share of rows;
the trainer pads a request with rows that weigh nothing (a copy of the first datum, outputs dropped) to a multiple
of the data-parallel shares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.tinker.datum import Datum
from reinforge.tinker.errors import TinkerRequestError
from reinforge.tinker.losses import OPTIONAL, REQUIRED, SAMPLED, check_inputs, datum_loss
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead, LogprobsAt, Loss
from reinforge.training.numerics import warn
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

TARGETS = LogprobsAt(ids="target_ids", into="target_logprobs")


@dataclass(frozen=True)
class AdamStep:
    """The SDK's AdamParams (its defaults): AdamW exactly as torch.optim.AdamW, weight decay decoupled."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass
class ForwardResult:
    outputs: list[dict[str, np.ndarray]]
    """Per datum, in request order: the loss's outputs (`logprobs`: the target logprobs, (N,) or (N, K))."""
    metrics: dict[str, float]
    """`loss:sum`: the request's loss, the sum of its datums'."""


@dataclass
class TinkerBatch(TrainBatch):
    """A request's datums as rows (see the module's docstring), with what the loss reads."""

    target_ids: torch.Tensor | None = None  # [B, T, K] long: datum position i's targets in column i + 1
    target_logprobs: torch.Tensor | None = None  # [B, T, K]: filled by the backend (`TARGETS`)
    values: torch.Tensor | None = None  # [B, T, F, K] float: the loss's inputs but the targets, by `TinkerLoss.names`
    width: torch.Tensor | None = None  # [B] long: K of a datum with K targets per position, 0 for (N,) targets
    row: torch.Tensor | None = None  # [B] long: the datum's index in the request, -1 for a padding row


class TinkerLoss:
    """A Tinker loss over a micro-batch of `TinkerBatch` rows: the sum of its datums' losses; each datum's outputs
    kept in `outputs` under its index (the trainer gathers them from the ranks)."""

    def __init__(self, loss_fn: str, config: dict, names: tuple[str, ...]):
        self.loss_fn, self.config, self.names = loss_fn, config, names
        self.outputs: dict[int, dict[str, np.ndarray]] = {}

    def __call__(self, outputs_BT: torch.Tensor, micro: TinkerBatch, norm: Normalisers):
        lp_BTK = micro.target_logprobs
        total = lp_BTK.sum() * 0.0  # in the graph even when every row is padding (each rank runs a backward)
        for b, row in enumerate(micro.row.tolist()):
            if row < 0:
                continue
            n, k = int(micro.attention_mask[b].sum()) - 1, int(micro.width[b])

            def take(x: torch.Tensor) -> torch.Tensor:  # [T, K] -> the datum's (N, K), or (N,)
                return x[1 : n + 1, :k] if k else x[1 : n + 1, 0]

            inputs = {name: take(micro.values[b, :, f]) for f, name in enumerate(self.names)}
            value, outputs = datum_loss(self.loss_fn, take(lp_BTK[b]), inputs, self.config)
            total = total + value
            self.outputs[row] = {name: out.detach().float().cpu().numpy() for name, out in outputs.items()}
        return total, {"loss:sum": total.detach()}


def input_names(loss_fn: str, datums: list[Datum]) -> tuple[str, ...]:
    """The inputs the loss reads but the targets, the same for every datum (an optional one in some datums only is
    an error: the datums of one request would follow different formulas)."""
    optional = []
    for name in OPTIONAL.get(loss_fn, ()):
        having = [name in d.inputs for d in datums]
        if any(having) and not all(having):
            raise TinkerRequestError(
                f"loss_fn_inputs[{name!r}] is in some datums of the request but not in datum "
                f"{having.index(False)}; give it to every datum or to none"
            )
        optional += [name] * all(having)
    return REQUIRED[loss_fn][1:] + tuple(optional) + ((SAMPLED,) if loss_fn == "stable_reinforce" else ())


def tinker_batch(datums: list[Datum], names: tuple[str, ...], shares: int) -> TinkerBatch:
    """The request's datums as right-padded rows, then padding rows up to a multiple of `shares`."""
    rows = list(range(len(datums))) + [-1] * (-len(datums) % shares)
    width = max(len(d.tokens) for d in datums) + 1
    k = max(np.shape(d.inputs["target_tokens"])[1] if np.ndim(d.inputs["target_tokens"]) == 2 else 1 for d in datums)
    size = len(rows)
    batch = TinkerBatch(
        input_ids=torch.zeros((size, width), dtype=torch.long),
        attention_mask=torch.zeros((size, width), dtype=torch.long),
        loss_mask=torch.zeros((size, width)),
        advantages=torch.zeros((size, width)),
        gen_logprobs=torch.zeros((size, width)),
        target_ids=torch.zeros((size, width, k), dtype=torch.long),
        values=torch.zeros((size, width, len(names), k)),
        width=torch.zeros(size, dtype=torch.long),
        row=torch.tensor(rows, dtype=torch.long),
    )
    for b, row in enumerate(rows):
        datum, n = datums[max(row, 0)], len(datums[max(row, 0)].tokens)
        batch.input_ids[b, :n] = torch.tensor(datum.tokens)
        batch.attention_mask[b, : n + 1] = 1
        batch.loss_mask[b, 1 : n + 1] = 1.0
        targets = columns(datum.inputs["target_tokens"], np.int64)
        batch.target_ids[b, 1 : n + 1, : targets.shape[1]] = targets
        batch.width[b] = targets.shape[1] if np.ndim(datum.inputs["target_tokens"]) == 2 else 0
        for f, name in enumerate(names):
            value = columns(datum.sampled if name == SAMPLED else datum.inputs[name], np.float32)
            batch.values[b, 1 : n + 1, f, : value.shape[1]] = value
    return batch


def columns(value, dtype) -> torch.Tensor:
    """An input, (N,) or (N, K), as an [N, K] tensor."""
    tensor = torch.as_tensor(np.asarray(value, dtype=dtype))
    return tensor if tensor.ndim == 2 else tensor[:, None]


class TinkerTrainer:
    """Tinker's training calls on a reinforge training backend: a `Backend` in this process, or on FSDP2 ranks (one
    `Backend` per rank, each with its own `TinkerTrainer`, or cluster/fsdp2_trainer.py's `FSDP2Ranks` in the
    driver). `vocab_size`: token ids at or past it are a request error (by default the backend model's)."""

    def __init__(self, backend, vocab_size: int | None = None) -> None:
        self.backend = backend
        self.shares = getattr(backend, "shares", None) or backend.config.parallel.data_parallel
        if vocab_size is None and hasattr(backend, "model"):
            vocab_size = backend.model.get_input_embeddings().num_embeddings
        self.vocab_size = vocab_size

    def forward_backward(self, datums: list[Datum], loss_fn: str, config: dict, backward: bool) -> ForwardResult:
        """The loss's outputs and `loss:sum` over the datums; with `backward` its gradient added to the parameters'
        accumulated gradients (until `optim_step`), else computed in eval mode without gradients (Tinker's
        forward). A bad request raises `TinkerRequestError` before anything runs."""
        check_inputs(loss_fn, config, datums)
        self._check_ids(datums)
        names = input_names(loss_fn, datums)
        loss = Loss(TinkerLoss(loss_fn, dict(config), names), (TARGETS,))
        metrics, ranks = self.backend.loss_pass(tinker_batch(datums, names, self.shares), loss, backward)
        outputs = {row: out for rank_loss in ranks for row, out in rank_loss.fn.outputs.items()}
        missing = [i for i in range(len(datums)) if i not in outputs]
        assert not missing, f"no rank computed the outputs of datums {missing}"
        return ForwardResult(
            [outputs[i] for i in range(len(datums))], {name: v for name, v in metrics.items() if ":" in name}
        )

    def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """One AdamW step on the accumulated gradients; its metrics (`optim/grad_norm` before clipping, `optim/lr`,
        `optim/nonfinite_steps`: skipped steps so far, and `optim/skipped` 1 when this one was)."""
        values = [adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm]
        if not all(np.isfinite(values)) or min(values) < 0 or max(adam.beta1, adam.beta2) >= 1:
            raise TinkerRequestError(f"adam_params {adam} must be finite, not negative, with beta1 and beta2 below 1")
        betas = (adam.beta1, adam.beta2)
        metrics, note = self.backend.adam_step(
            adam.learning_rate, betas, adam.eps, adam.weight_decay, adam.grad_clip_norm
        )
        if note:
            warn(note)
        return {
            "optim/grad_norm": metrics["grad_norm"],
            "optim/lr": metrics["lr"],
            "optim/nonfinite_steps": metrics["nonfinite_steps"],
            "optim/skipped": float(note is not None),
        }

    def _check_ids(self, datums: list[Datum]) -> None:
        if self.vocab_size is None:
            return
        for index, datum in enumerate(datums):
            for what, ids in (("model_input", datum.tokens), ("target_tokens", datum.inputs["target_tokens"])):
                outside = [int(i) for i in np.ravel(ids) if not 0 <= int(i) < self.vocab_size]
                if outside:
                    raise TinkerRequestError(
                        f"datum {index}: {what} holds token id {outside[0]}, outside the model's vocabulary "
                        f"(ids 0 to {self.vocab_size - 1})"
                    )


def build_tinker_backend(
    model_config: ModelConfig, training: TrainingConfig, cluster, lora_rank: int | None, seed: int = 0
) -> tuple[TinkerTrainer, Callable[[], None]]:
    """A training client's trainer and the call that frees it: the base model with LoRA adapters of `lora_rank`
    (alpha, dropout and target modules from `model_config.lora`, or LoRA's defaults; `seed` draws the adapters'
    initial weights) or, with None, all its weights trained; on this process (`training.backend=torch`) or on
    `training.num_workers` FSDP2 ranks in Ray actors (Ray started if it is not running; whoever stops the server
    stops Ray). The head gives logprobs at temperature 1; AdamW's settings come with each optim_step."""
    lora = None if lora_rank is None else (model_config.lora or LoraConfig()).model_copy(update={"rank": lora_rank})
    model = model_config.model_copy(update={"lora": lora})
    kwargs: dict[str, Any] = dict(
        model_config=model, optimizer=OptimizerConfig(), scheduler=SchedulerConfig(), num_optimizer_steps=1
    )
    head = LogprobHead(temperature=1.0)
    if training.backend == "torch":
        from reinforge.training.backend import Backend

        torch.manual_seed(seed)
        backend = Backend(training=training, head=head, **kwargs)
        return TinkerTrainer(backend), backend.shutdown
    from reinforge.cluster import worker_group
    from reinforge.cluster.fsdp2_group import seeded_load
    from reinforge.cluster.fsdp2_trainer import FSDP2Ranks
    from reinforge.modeling import skeleton
    from reinforge.training.parallel.layout import ParallelConfig

    if training.parallel == "auto":  # plain data parallelism: a request's datums shared by the ranks
        training = training.model_copy(update={"parallel": ParallelConfig()})
    worker_group.ensure_ray(cluster, training.num_workers * cluster.num_cpus_per_worker)
    head = replace(head, load_model=partial(seeded_load, load_model=head.load_model, seed=seed))
    ranks = FSDP2Ranks("tinker-training", training, cluster, {**kwargs, "head": head})
    vocab_size = skeleton(model).get_input_embeddings().num_embeddings
    return TinkerTrainer(ranks, vocab_size), ranks.shutdown
