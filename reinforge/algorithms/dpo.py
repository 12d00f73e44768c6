"""DPO from preference pairs: the recipe the supervised loop (loops/supervised.py) runs.

Before training: tokenize the pairs (prompt with the generation prompt, then each reply and its
end-of-turn token: the tokens the policy would generate); compute the reference policy's sequence
logprobs of the held-out pairs, and of the training pairs too with `dpo.reference=precompute`.
Each step the loop draws a global batch of pairs; here: their reference logprobs (looked up, or computed now by
the frozen reference), and the loss on the policy's sequence logprobs of both replies: DPO's (plus an optional NLL
term on the chosen replies). At the end, the policy in Hugging Face format.

As implemented, relative to DPO (Rafailov et al. 2023, arXiv:2305.18290):
1. The reference policy is the starting model (the paper's pi_SFT). `dpo.reference=per_batch` (the
   default) keeps a frozen copy that computes each batch's reference logprobs; `precompute` computes
   them for every pair once, with the policy itself before the first update, so no second model is
   kept in memory (the same numbers, up to float rounding in differently padded batches).
2. Optional NLL on the chosen replies, `dpo.sft_weight` x their mean per-token negative log-likelihood
   over the global batch, as in RPO (Pang et al. 2024, arXiv:2404.19733); off by default.
3. A sequence's logprob is the sum over its reply tokens, end-of-turn token included; prompt tokens
   are never trained on. The loss is averaged over the pairs of the global batch.

With `model.lora` only PEFT's LoRA adapters are trained, and the reference is the same model with its
adapters disabled (with either `dpo.reference`: no second model); `final/` holds the adapter in PEFT's
format (training/lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from reinforge.algorithms.dpo_config import DPOConfig, DPORunConfig
from reinforge.algorithms.losses import dpo_loss, sequence_logprobs, token_mean
from reinforge.algorithms.pairs import PairRecipe, PairTrainBatch, chosen_and_rejected, pair_batch
from reinforge.algorithms.supervised_recipe import RecipeModel
from reinforge.data.batch import Normalisers
from reinforge.data.preference import TokenizedPair, tokenize_for_policy
from reinforge.logging.metrics import Timers
from reinforge.modeling import load_processor
from reinforge.training.base import LossFn
from reinforge.training.heads import LogprobHead


class DPO(PairRecipe):
    """The policy's LM head at temperature 1, and the reference: a frozen copy of the starting model
    (`dpo.reference=per_batch`), or its logprobs computed once by the starting policy (`precompute`); with LoRA the
    policy with its adapters disabled."""

    title, summary = "DPO", ("reward_margin", "preference_accuracy", "logp_accuracy")

    def __init__(self, config: DPORunConfig, tokenizer: PreTrainedTokenizerBase):
        self.dpo = config.dpo
        model = RecipeModel(LogprobHead(temperature=1.0), load_reference=self.dpo.reference == "per_batch")
        # a vision-language model's processor: pairs may hold images
        super().__init__(config, tokenizer, tokenize_for_policy, model, load_processor(config.model))
        # the frozen copy, else the policy: adapters off, or (precompute) not yet updated
        self.use_reference = self.dpo.reference == "per_batch" or config.model.lora is not None
        self.backend = self.train_ref_N2 = self.val_ref_B = None

    def start(self, backend) -> None:
        """The references the starting model gives: the held-out pairs', and with `precompute` every training
        pair's."""
        self.backend = backend
        self.val_ref_B = self.reference_logprobs(self.val)
        if self.dpo.reference == "precompute":
            self.train_ref_N2 = self.reference_logprobs(self.examples).view(-1, 2)

    def reference_logprobs(self, pairs: list[TokenizedPair]) -> torch.Tensor:
        """Sequence logprobs [2N] of the pairs' replies (chosen 0, rejected 0, ...) under the reference."""
        if not pairs:
            return torch.zeros(0)
        batch = pair_batch(pairs, self.pad_id)
        return sequence_logprobs(self.backend.per_token(batch, reference=self.use_reference), batch.loss_mask)

    def train_batch(self, indices: list[int], timers: Timers) -> tuple[DPOBatch, LossFn]:
        pairs = [self.examples[i] for i in indices]
        with timers.time("reference"):
            if self.train_ref_N2 is not None:
                reference_B = self.train_ref_N2[indices].flatten()
            else:
                reference_B = self.reference_logprobs(pairs)
        batch = pair_batch(pairs, self.pad_id, batch_type=DPOBatch, reference_B=reference_B)
        return batch, make_loss_fn(pairs, self.dpo)

    def val_batch(self) -> tuple[DPOBatch, LossFn]:
        batch = pair_batch(self.val, self.pad_id, batch_type=DPOBatch, reference_B=self.val_ref_B)
        return batch, make_loss_fn(self.val, self.dpo)


@dataclass
class DPOBatch(PairTrainBatch):
    """Pairs with the reference policy's sequence logprob of each of their sequences."""

    reference_B: torch.Tensor | None = None  # [B]: log pi_ref of each sequence's reply


def make_loss_fn(pairs: list[TokenizedPair], d: DPOConfig):
    """The DPO (+ NLL) loss of a micro-batch of a global batch of `pairs`, over the policy's per-token logprobs."""
    num_chosen_tokens = sum(len(p.chosen_ids) - p.num_prompt_tokens for p in pairs)  # the NLL term's normaliser

    def loss_fn(logprobs_BT: torch.Tensor, micro: DPOBatch, norm: Normalisers):
        num_pairs = norm.num_sequences // 2
        chosen_P, rejected_P, _ = chosen_and_rejected(sequence_logprobs(logprobs_BT, micro.loss_mask), micro)
        ref_chosen_P, ref_rejected_P, _ = chosen_and_rejected(micro.reference_B, micro)
        loss, metrics = dpo_loss(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P, num_pairs, beta=d.beta)
        chosen_mask_BT = micro.loss_mask * micro.chosen.unsqueeze(1)
        sft = token_mean(
            -logprobs_BT, chosen_mask_BT, Normalisers(num_tokens=num_chosen_tokens, num_sequences=num_pairs)
        )
        with torch.no_grad():
            margin_P = chosen_P - rejected_P
            metrics["logp_accuracy"] = ((margin_P > 0).float() + 0.5 * (margin_P == 0).float()).sum() / num_pairs
        metrics.update(dpo_loss=metrics["loss"], sft_loss=sft.detach())
        if d.sft_weight > 0:
            loss = loss + d.sft_weight * sft
            metrics["loss"] = loss.detach()
        return loss, metrics

    return loss_fn
