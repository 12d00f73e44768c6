"""A Bradley-Terry reward model from preference pairs: the recipe the supervised loop (loops/supervised.py) runs.

The model is the causal LM of `model.name_or_path` with its LM head replaced by a freshly initialised
scalar head (transformers' `AutoModelForSequenceClassification`, `num_labels=1`); the reward of a
conversation is the head's output at its last non-pad token. Both conversations of each pair are rendered with
the chat template (exactly as `RewardModelScorer` does when serving the model); each step the loop draws a
global batch of pairs, whose loss is Bradley-Terry's, -log sigmoid(r_chosen - r_rejected), on the rewards of
chosen and rejected; validation measures the held-out pairs' accuracy. At
the end the model and its tokenizer are saved in Hugging Face format, ready for
`python -m reinforge.envs.reward_model_server RUN_DIR/final` or the judge environment's `local` mode.

As implemented, relative to the reward model of InstructGPT (Ouyang et al. 2022, arXiv:2203.02155):
one pair per prompt rather than all K-choose-2 comparisons of K ranked answers, and no reward
normalisation after training (GRPO's group-normalised advantages do not need it; the judge's
`reward_model_transform: sigmoid` maps scores into (0, 1) where a bounded reward is wanted).

With `model.lora` the body gets PEFT's LoRA adapters and the new scalar head is trained whole (PEFT's
`modules_to_save` for a sequence classifier): those are the only parameters in AdamW. `final/` then holds
the adapter and the head in PEFT's format, which `RewardModelScorer` (the judge's local mode and the
reward-model server) merges onto the base when it loads it.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.algorithms.losses import bradley_terry_loss
from reinforge.algorithms.pairs import PairRecipe, PairTrainBatch, chosen_and_rejected, pair_batch
from reinforge.algorithms.rm_config import RMRunConfig
from reinforge.algorithms.supervised_recipe import RecipeModel
from reinforge.data.batch import Normalisers
from reinforge.data.preference import tokenize_for_reward_model
from reinforge.errors import ReinforgeError
from reinforge.logging.metrics import Timers
from reinforge.model_config import ModelConfig
from reinforge.modeling import DTYPES, adapter_base, model_location
from reinforge.training.base import LossFn
from reinforge.training.heads import ScalarHead
from reinforge.training.lora import absolute_location, add_lora, inner_model


class RM(PairRecipe):
    """The reward of a conversation: a new scalar head on its last token's hidden state (seeded by `seed`, as the
    FSDP2 ranks seed it); the loss, Bradley-Terry's."""

    title, summary = "RM", ("preference_accuracy", "reward_margin")

    def __init__(self, config: RMRunConfig, tokenizer: PreTrainedTokenizerBase):
        load = partial(load_scorer, pad_token_id=tokenizer.pad_token_id)
        head = ScalarHead("score", from_previous_token=False, load_model=load, causal_lm=False)
        super().__init__(config, tokenizer, tokenize_for_reward_model, RecipeModel(head))

    def train_batch(self, indices: list[int], timers: Timers) -> tuple[PairTrainBatch, LossFn]:
        return pair_batch([self.examples[i] for i in indices], self.pad_id, last_token_only=True), rm_loss

    def val_batch(self) -> tuple[PairTrainBatch, LossFn]:
        return pair_batch(self.val, self.pad_id, last_token_only=True), rm_loss


def load_reward_model(config: ModelConfig, pad_token_id: int) -> PreTrainedModel:
    """The causal LM's body (with `model.adapter` merged in) under a new one-output head; the pad id tells the
    pooling where each sequence ends."""
    location = model_location(config)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            location, num_labels=1, dtype=DTYPES[config.dtype], trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError) as exc:  # ValueError: an architecture without a sequence-classification head
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: could not load it as a reward model "
            f"({str(exc).strip().splitlines()[0]})"
        ) from None
    model.config.pad_token_id = pad_token_id
    if config.adapter:  # a LoRA policy's adapter: its keys name the body's modules, which the classifier shares
        from peft import PeftConfig, PeftModel

        path = adapter_base(config)
        adapter_config = PeftConfig.from_pretrained(path)
        adapter_config.task_type = (
            None  # PEFT's causal-LM wrapper needs an LM head; the plain one merges the body's layers
        )
        model = PeftModel.from_pretrained(model, path, config=adapter_config).merge_and_unload()
    return model


def load_scorer(model_config: ModelConfig, pad_token_id: int):
    """The reward model to train and its PeftModel (with `model.lora`: the body's adapters and the whole new head)."""
    model = load_reward_model(model_config, pad_token_id)
    peft_model = (
        add_lora(model, model_config.lora, absolute_location(model_config), task_type="SEQ_CLS")
        if model_config.lora
        else None
    )
    return inner_model(peft_model or model), peft_model


def rm_loss(rewards_BT: torch.Tensor, micro: PairTrainBatch, norm: Normalisers):
    """The Bradley-Terry loss of a micro-batch: each sequence's reward is the head at its last token (its one
    loss-mask position), averaged over the global batch's pairs."""
    chosen_P, rejected_P, _ = chosen_and_rejected(rewards_BT.sum(dim=1), micro)
    return bradley_terry_loss(chosen_P, rejected_P, norm.num_sequences // 2)
