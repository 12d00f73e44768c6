"""SFT, DPO and RM with `training.backend=fsdp2`: the recipe's model on `training.num_workers` FSDP2 ranks (the
training backend with the recipe's head and an `FSDP2Strategy` each, in Ray actors; cluster/fsdp2_trainer.py's
`FSDP2Ranks`), behind what the recipes call of the in-process backend: `train_step`, `evaluate`, `per_token`,
`plan`, `num_parameters`, `save_pretrained`/`save_adapter`, `memory_metrics`, `shutdown`.

Every data-parallel rank (`training.parallel`'s dp_replicate x dp_shard; the tensor- and context-parallel ranks of
a share work on it together) gets the whole batch and works on its contiguous share of rows, so a training batch
must split into
equal shares of whole row groups (`rows_together`: a preference pair's chosen and rejected rows, which the pair
losses need in one micro-batch); the recipes' configs check that. A held-out batch (or DPO's reference pass over
the training pairs) may have any size: the rows that split evenly go in one pass; the few left over (fewer than
one row group per rank) go in a second pass in which every rank computes all of them, their summed metrics
divided by the number of ranks. Both passes divide by the normalisers of the whole batch, so the metrics are
those of one pass over it.

Every rank seeds torch with the run's `seed` just before it loads the model, as the driver does before loading
it in one process, so freshly initialised weights (`sft.random_init`, the reward model's score head, LoRA's A
matrices) are the same on every rank and the same as in one process.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from reinforge.cluster.config import TrainerClusterConfig
from reinforge.cluster.fsdp2_trainer import FSDP2Ranks
from reinforge.data.batch import TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.training.base import LossFn
from reinforge.training.heads import LoadModel
from reinforge.training.micro_batching import MicroBatchPlan, Prompts, plan_micro_batches, split_to


def seeded_load(model_config: ModelConfig, load_model: LoadModel, seed: int):
    """`load_model` after `torch.manual_seed(seed)`, in the rank's process."""
    torch.manual_seed(seed)
    return load_model(model_config)


class FSDP2Group(FSDP2Ranks):
    def __init__(
        self, backend_kwargs: dict[str, Any], cluster: TrainerClusterConfig, seed: int, rows_together: int = 1
    ):
        """`backend_kwargs`: the in-process `Backend`'s arguments (its `training`, `head`, `row_tokens`, ...)."""
        kwargs = dict(backend_kwargs)
        self.training, self.row_tokens = kwargs.pop("training"), kwargs.get("row_tokens")
        self.rows_together = rows_together  # `shares`: FSDP2Ranks'
        head = kwargs["head"]
        kwargs["head"] = replace(head, load_model=partial(seeded_load, load_model=head.load_model, seed=seed))
        super().__init__("training", self.training, cluster, kwargs)

    def num_parameters(self) -> tuple[int, int]:
        return self.group.call("num_parameters")[0]

    def plan(self, lengths: list[int], prompts: Prompts | None) -> MicroBatchPlan:
        """The micro-batches the ranks run, rank by rank (indices into the whole batch): each plans its share and
        splits its micro-batches up to the largest count, as `FSDP2Strategy.micro_batches` does."""
        assert prompts is None, "the recipes on FSDP2 ranks share no prompts"
        size = len(lengths) // self.shares
        shares = [range(rank * size, (rank + 1) * size) for rank in range(self.shares)]
        plans = [plan_micro_batches(lengths[s.start : s.stop], self.training, None, self.row_tokens) for s in shares]
        count = max(len(p) for p in plans)
        return [
            [[share.start + i for i in row] for row in rows]
            for share, plan in zip(shares, plans)
            for rows in split_to(plan, count)
        ]

    def evaluate(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for part, _, copies in self._passes(batch):
            for name, value in self.group.call("evaluate", part, loss_fn)[0].items():
                if name.endswith(("_max", "_min")):
                    pick = max if name.endswith("_max") else min
                    metrics[name] = pick(metrics[name], value) if name in metrics else value
                else:
                    metrics[name] = metrics.get(name, 0.0) + value / copies
        return metrics

    def per_token(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        out_BT = torch.zeros_like(batch.loss_mask)
        for part, rows, _ in self._passes(batch):
            values_BT = self.group.call("per_token", part, reference)[0][: len(rows)]
            out_BT[rows, : values_BT.shape[1]] = values_BT
        return out_BT

    def _passes(self, batch: TrainBatch) -> list[tuple[TrainBatch, list[int], int]]:
        """(a batch that splits evenly over the ranks, the rows of `batch` it holds, its copies of them): the first
        rows, in whole row groups per rank, then the rest, whole on every rank; both with `batch`'s normalisers."""
        norm, unit = batch.normalisers(), self.shares * self.rows_together
        cut = len(batch) - len(batch) % unit
        passes = []
        if cut:
            passes.append((replace(batch.slice(0, cut), loss_normalisers=norm), list(range(cut)), 1))
        if cut < len(batch):
            rest = list(range(cut, len(batch)))
            everywhere = batch.select(rest * self.shares)
            passes.append((replace(everywhere, loss_normalisers=norm), rest, self.shares))
        return passes
