"""Each GRPO-family config builds the loss its paper describes: `policy_loss.policy_loss_fn` of its `loss` section on a
tiny batch equals the hand-written objective."""

import math

import pytest
import torch

from reinforge.algorithms.grpo_config import GRPORunConfig, load_config
from reinforge.algorithms.policy_loss import PolicyLossConfig, policy_loss_fn
from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.paths import PROJECT_ROOT


def tiny_batch(mask_BT: torch.Tensor, advantages_B: torch.Tensor) -> TrainBatch:
    """A batch whose old logprobs are all 0, so the policy's logprobs are the log ratios; each sequence's advantage
    on its masked tokens, as `collate` spreads it."""
    batch = TrainBatch(
        input_ids=torch.zeros_like(mask_BT, dtype=torch.long),
        attention_mask=torch.ones_like(mask_BT, dtype=torch.long),
        loss_mask=mask_BT,
        advantages=advantages_B[:, None] * mask_BT,
        gen_logprobs=torch.zeros_like(mask_BT),
    )
    batch.old_logprobs = torch.zeros_like(mask_BT)
    return batch


def load(method: str, *overrides: str):
    return load_config(PROJECT_ROOT / "configs" / f"{method}_demo.yaml", list(overrides))


def make_loss_fn(config: GRPORunConfig, loss: PolicyLossConfig | None = None):
    """The loss GRPO trains `config` with (grpo.py's call)."""
    return policy_loss_fn(loss or config.loss, config.generation.max_new_tokens, config.off_policy)


@pytest.mark.parametrize("method", ["dapo", "gspo", "dr_grpo", "rloo", "reinforce_pp", "cispo"])
def test_every_variant_config_loads_and_inherits_the_demo(method):
    config = load(method)
    assert config.model.name_or_path == "models/demo" and config.logging.run_dir == f"runs/{method}_demo"


def test_gspo_config_clips_the_sequence_ratio_and_averages_per_sequence():
    """Log ratios row 0 [1e-4, 3e-4] -> s = exp(2e-4) = 1.0002, inside [1 - 3e-4, 1 + 4e-4]; row 1 [1e-3]
    -> s = exp(1e-3) = 1.0010005 > 1.0004, clipped. A = [+1, +1]: loss = -(1.0002 + 1.0004) / 2 = -1.0003
    (one term per sequence); row 1's single token is the one clipped token of 3: clip fraction 1/3."""
    config = load("gspo")
    batch = tiny_batch(torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([1.0, 1.0]))
    loss, metrics = make_loss_fn(config)(torch.tensor([[1e-4, 3e-4], [1e-3, 0.0]]), batch, Normalisers(3, 2))
    torch.testing.assert_close(loss, torch.tensor(-(math.exp(2e-4) + 1.0004) / 2))
    torch.testing.assert_close(metrics["clip_fraction"], torch.tensor(1 / 3))


def test_dr_grpo_config_divides_by_sequences_times_the_generation_limit():
    """Ratio 1 everywhere, A = [+1, -0.5], 3 and 1 valid tokens: pg per token [-1, -1, -1] and [0.5];
    sum = -2.5; divided by 2 sequences x max_new_tokens 48 = 96: -0.0260417 (not -2.5/4 tokens, not a per-sequence
    mean)."""
    config = load("dr_grpo")
    assert config.generation.max_new_tokens == 48 and not config.grpo.normalize_std
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    batch = tiny_batch(mask, torch.tensor([1.0, -0.5]))
    loss, _ = make_loss_fn(config)(torch.zeros(2, 3), batch, Normalisers(4, 2))
    torch.testing.assert_close(loss, torch.tensor(-2.5 / 96))


def test_constant_normaliser_tokens_overrides_the_generation_limit():
    config = load("dr_grpo", "loss.constant_normaliser_tokens=10")
    batch = tiny_batch(torch.ones(1, 2), torch.tensor([1.0]))
    loss, _ = make_loss_fn(config)(torch.zeros(1, 2), batch, Normalisers(2, 1))
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 10))


def test_variant_settings_that_do_not_fit_are_rejected_with_the_field_and_the_fix():
    with pytest.raises(ValueError, match="overlong.buffer_tokens=64 must be in \\[0, generation.max_new_tokens=48\\]"):
        load("dapo", "overlong.buffer_tokens=64")
    with pytest.raises(ValueError, match="multiple of training.num_workers"):
        load(
            "dapo",
            "training.backend=fsdp2",
            "training.num_workers=3",
            "training.global_batch_size=96",
            "training.micro_batch_size=32",
            "rollout.num_prompts_per_step=36",
        )
    with pytest.raises(ValueError, match="overlong.buffer_tokens > 0 needs rollout.max_turns=1"):
        load("dapo", "rollout.max_turns=3")
    with pytest.raises(ValueError, match="constant_normaliser_tokens must be > 0"):
        load("dr_grpo", "loss.constant_normaliser_tokens=0")


def test_cispo_config_keeps_a_gradient_on_the_tokens_ppo_would_clip():
    """cispo_demo: no lower bound (eps_low 1.0), eps_high 0.28, k3 KL 0.001 (no reference given here, so only the
    policy term). Log ratios [ln 2, ln 0.1] with A = [+1, -1], token mean over 2: weights sg(clip) = 1.28 and 0.1;
    d loss / d logp = -w A / 2 = [-0.64, +0.05]. PPO's clip at [0.8, 1.28] gives both tokens no gradient."""
    config = load("cispo")
    assert (config.loss.policy_loss, config.loss.clip_eps_low, config.loss.clip_eps_high) == ("cispo", 1.0, 0.28)
    batch = tiny_batch(torch.ones(1, 2), torch.tensor([0.0]))
    batch.advantages = torch.tensor([[1.0, -1.0]])
    logp = torch.log(torch.tensor([[2.0, 0.1]])).requires_grad_()
    loss, _ = make_loss_fn(config, config.loss.model_copy(update={"kl_coef": 0.0}))(logp, batch, Normalisers(2, 1))
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([[-0.64, 0.05]]))


def test_reinforce_pp_config_uses_the_k2_estimator_and_token_whitening():
    config = load("reinforce_pp")
    assert config.loss.kl_estimator == "k2" and config.grpo.whiten_advantages and config.grpo.whiten_over == "tokens"
