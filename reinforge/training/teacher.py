"""A frozen teacher model for on-policy distillation (algorithms/distill.py), in this process.

It scores token ids the student generated: at every position on a batch's loss mask, its logprob of the
sampled token and, for the top-k KL, its k most likely token ids and their logprobs. It runs the student
backends' machinery (micro-batch plans, packing, prompt sharing, `trained_hidden_states`) so it sees the
same positions, and applies its LM head chunk by chunk: the [N, V] logits of one chunk exist at a time.
Logprobs are of softmax(logits / temperature), the generation temperature, as the student's are.
"""

from __future__ import annotations

import torch

from reinforge.data.batch import TrainBatch
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model
from reinforge.training.base import TrainingConfig
from reinforge.training.logit_transform import IDENTITY, LogitTransform
from reinforge.training.micro_batching import (
    HiddenStates,
    Prompts,
    model_layouts,
    plan_micro_batches,
    select_micro_batch,
    trained_hidden_states,
)


def topk_head(
    lm_head: torch.nn.Module,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    k: int,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [N] of the targets, top-k ids [N, k], their logprobs [N, k]) under
    softmax(transform(lm_head(hidden)) / temperature), `transform` the model's own after its head."""
    logp_NV = torch.log_softmax(transform(lm_head(hidden_NH).float()) / temperature, dim=-1)
    topk_logprobs_NK, topk_ids_NK = logp_NV.topk(k, dim=-1) if k else (logp_NV[:, :0], logp_NV[:, :0].long())
    return logp_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1), topk_ids_NK, topk_logprobs_NK


class Teacher:
    """A frozen causal LM (`model_config`, eval mode, no gradients) that scores batches of the student's tokens."""

    def __init__(self, model_config: ModelConfig, training_config: TrainingConfig, temperature: float):
        self.temperature = temperature
        self.model = load_model(model_config).eval().requires_grad_(False)
        self.config = model_layouts(self.model, training_config)
        self.hidden = HiddenStates(self.model)

    @torch.no_grad()
    def score(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs_BT of the batch's tokens, topk_ids_BTK, topk_logprobs_BTK), 0 off `batch.loss_mask`; k = 0: no
        top-k."""
        B, T = batch.loss_mask.shape
        logprobs_BT, ids_BTK, topk_BTK = torch.zeros(B, T), torch.zeros(B, T, k, dtype=torch.long), torch.zeros(B, T, k)
        prompts = Prompts.of(batch, self.config)
        for rows in plan_micro_batches(batch.attention_mask.sum(dim=1).tolist(), self.config, prompts):
            micro, local_rows, indices = select_micro_batch(batch, rows)
            hidden_NH, targets_N, (b_index, t_index) = trained_hidden_states(
                self.model, self.hidden, micro, local_rows, self.config
            )
            rows_N = torch.tensor(indices, dtype=torch.long)[b_index]
            chunk = self.config.logprob_chunk_tokens
            for start in range(0, len(targets_N), chunk):
                part = slice(start, start + chunk)
                logprobs_N, top_ids_NK, top_logprobs_NK = topk_head(
                    self.model.get_output_embeddings(),
                    hidden_NH[part],
                    targets_N[part],
                    self.temperature,
                    k,
                    self.hidden.transform,
                )
                where = (rows_N[part], t_index[part])
                logprobs_BT[where], ids_BTK[where], topk_BTK[where] = (
                    logprobs_N.cpu(),
                    top_ids_NK.cpu(),
                    top_logprobs_NK.cpu(),
                )
        return logprobs_BT, ids_BTK, topk_BTK
