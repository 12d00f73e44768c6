"""One optimizer step over a global batch of pairs: micro-batching must not change the gradient."""

import pytest
import torch

from reinforge.algorithms import dpo, rm
from reinforge.algorithms.pairs import optimizer_step
from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.data.preference import PreferenceDataConfig, load_pairs, tokenize_for_policy, tokenize_for_reward_model
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.training.torch_backend import build_optimizer

DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
PAIRS = str(PROJECT_ROOT / "data" / "demo" / "preference_val.jsonl")


def gradients_after_one_step(model, pairs, make_loss, micro_batch_size):
    training = TrainingConfig(global_batch_size=2 * len(pairs), micro_batch_size=micro_batch_size, lr=1e-4)
    optimizer, scheduler = build_optimizer(model.parameters(), training, 1)
    metrics = optimizer_step(model, optimizer, scheduler, pairs, make_loss(model), training, pad_token_id=0)
    return [p.grad.clone() for p in model.parameters()], metrics


@pytest.mark.parametrize("recipe", ["dpo", "rm"])
def test_micro_batches_of_one_pair_give_the_gradient_and_metrics_of_the_whole_batch(recipe):
    tokenizer = load_tokenizer(DEMO)
    tokenize = tokenize_for_policy if recipe == "dpo" else tokenize_for_reward_model
    pairs = load_pairs(PAIRS, tokenizer, tokenize, PreferenceDataConfig())[:6]
    if recipe == "dpo":
        reference = load_model(DEMO)
        ref_N2 = (
            dpo.reply_logprobs(reference, pairs, 12, tokenizer.pad_token_id) - 0.5
        )  # a reference that differs from the policy

        def make_loss(model):
            return dpo.make_micro_loss(model, pairs, ref_N2, dpo.DPOConfig(beta=0.3, sft_weight=0.7))

        def load():
            return load_model(DEMO)
    else:
        make_loss = rm.make_micro_loss

        def load():
            torch.manual_seed(0)  # the same fresh scalar head both times
            return rm.load_reward_model(DEMO, tokenizer.pad_token_id)

    whole_grads, whole_metrics = gradients_after_one_step(load(), pairs, make_loss, micro_batch_size=12)
    micro_grads, micro_metrics = gradients_after_one_step(load(), pairs, make_loss, micro_batch_size=2)
    for whole, micro in zip(whole_grads, micro_grads):
        torch.testing.assert_close(micro, whole, atol=1e-6, rtol=1e-4)
    assert whole_metrics.keys() == micro_metrics.keys()
    for name, value in whole_metrics.items():
        assert micro_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
