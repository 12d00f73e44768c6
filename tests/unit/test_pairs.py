"""One optimizer step over a global batch of pairs through the training backend: micro-batching and packing must
not change the gradient or the metrics (DPO with the policy's LM head, the reward model with its scalar head)."""

from functools import partial

import pytest
import torch

from reinforge.algorithms import dpo, rm
from reinforge.algorithms.losses import sequence_logprobs
from reinforge.algorithms.pairs import PairTrainingConfig, pair_batch
from reinforge.data.preference import PreferenceDataConfig, load_pairs, tokenize_for_policy, tokenize_for_reward_model
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.training.backend import Backend
from reinforge.training.heads import LogprobHead, ScalarHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
PAIRS = str(PROJECT_ROOT / "data" / "demo" / "preference_val.jsonl")
NUM_PAIRS = 6
# (micro-batch size in sequences, packing): the whole batch padded, then micro-batches of one pair, padded and packed
LAYOUTS = [(2 * NUM_PAIRS, False), (2, False), (2, True), (4, True)]


def backend_for(recipe: str, micro_batch_size: int, packing: bool, pad_token_id: int) -> Backend:
    """A fresh policy (DPO) or reward model (RM, its new scalar head seeded the same each time) as the recipe
    builds it, from the recipe's `training:` section."""
    if recipe == "dpo":
        head = LogprobHead(temperature=1.0)
    else:  # rm.RM's head: the score of a conversation at its last token
        load = partial(rm.load_scorer, pad_token_id=pad_token_id)
        head = ScalarHead("score", from_previous_token=False, load_model=load, causal_lm=False)
    torch.manual_seed(0)
    return Backend(
        DEMO,
        PairTrainingConfig(
            global_batch_size=2 * NUM_PAIRS, micro_batch_size=micro_batch_size, sequence_packing=packing
        ).backend_config(),
        OptimizerConfig(lr=1e-4),
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=head,
    )


def gradients_after_one_step(recipe, pairs, pad_token_id, micro_batch_size, packing):
    backend = backend_for(recipe, micro_batch_size, packing, pad_token_id)
    if recipe == "dpo":
        # a reference that differs from the policy: 0.5 less likely to give each chosen reply
        plain = pair_batch(pairs, pad_token_id)
        reference_B = sequence_logprobs(backend.per_token(plain), plain.loss_mask) - 0.5 * plain.chosen.float()
        batch = pair_batch(pairs, pad_token_id, batch_type=dpo.DPOBatch, reference_B=reference_B)
        loss_fn = dpo.make_loss_fn(pairs, dpo.DPOConfig(beta=0.3, sft_weight=0.7))
    else:
        batch, loss_fn = pair_batch(pairs, pad_token_id, last_token_only=True), rm.rm_loss
    metrics = backend.accumulate_gradients(batch, loss_fn)  # train_step would free the gradients after its step
    return [p.grad.clone() for p in backend.trainable], metrics


@pytest.mark.parametrize("recipe", ["dpo", "rm"])
def test_micro_batches_of_pairs_packed_or_padded_give_the_gradient_and_metrics_of_the_whole_batch(recipe):
    tokenizer = load_tokenizer(DEMO)
    tokenize = tokenize_for_policy if recipe == "dpo" else tokenize_for_reward_model
    pairs = load_pairs(PAIRS, tokenizer, tokenize, PreferenceDataConfig())[:NUM_PAIRS]
    (whole_grads, whole_metrics), *others = [
        gradients_after_one_step(recipe, pairs, tokenizer.pad_token_id, size, packing) for size, packing in LAYOUTS
    ]
    assert max(g.abs().max() for g in whole_grads) > 0
    if recipe == "dpo":
        # implicit margin beta * 0.5 = 0.15 on every pair: -log sigmoid(0.15) = ln(1 + e^-0.15) = 0.62096
        assert whole_metrics["dpo_loss"] == pytest.approx(0.62096, abs=1e-5) and whole_metrics["sft_loss"] > 0
    for layout, (grads, metrics) in zip(LAYOUTS[1:], others):
        for whole, micro in zip(whole_grads, grads):
            torch.testing.assert_close(micro, whole, atol=1e-6, rtol=1e-4, msg=str(layout))
        assert whole_metrics.keys() == metrics.keys()
        for name, value in whole_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), (layout, name)
