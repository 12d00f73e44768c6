"""PPO's critic (training/critic.py): values through packed, shared-prompt and token-budget micro-batches
equal the padded one-batch computation, its gradient accumulates to the one-batch gradient, it fits
returns, and a checkpoint round trip repeats the next step exactly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from reinforge.algorithms.ppo import CriticBatch, make_value_loss_fn
from reinforge.data.batch import Trajectory, collate
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.critic import critic_backend
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.state import model_state_dict


def ragged_batch(num_rows=8, seed=0) -> CriticBatch:
    """Prompts of 2-6 tokens (every two rows share one, as a group's samples do), answers of 1-10, one
    multi-turn answer with an environment span masked out; random returns and rollout values."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(num_rows):
        if row % 2 == 0:
            prompt = torch.randint(2, 64, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        num_response = int(torch.randint(1, 11, (1,), generator=gen))
        response = torch.randint(2, 64, (num_response,), generator=gen).tolist()
        mask = [1, 0, 0] + [1] * (num_response - 3) if row == 3 and num_response > 4 else None
        trajectories.append(
            Trajectory(prompt, response, [0.0] * num_response, False, 0.0, row // 2, "math", response_mask=mask)
        )
    batch = collate(trajectories, [0.0] * num_rows, pad_token_id=0)
    batch = CriticBatch(**vars(batch))
    batch.returns = torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    batch.old_values = 0.1 * torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    return batch


def make_critic(model_dir, **training) -> Backend:
    torch.manual_seed(0)
    config = TrainingConfig(**{"micro_batch_size": 8, "global_batch_size": 8, **training})
    critic = critic_backend(
        ModelConfig(name_or_path=str(model_dir)), config, OptimizerConfig(lr=1e-2), SchedulerConfig(), 10
    )
    with torch.no_grad():  # a non-zero head, so that values (and the trunk's gradients) are not all 0
        critic.model.value_head.weight.copy_(
            torch.randn(critic.model.value_head.weight.shape, generator=torch.Generator().manual_seed(3))
        )
    return critic


def padded_values(critic: Backend, batch: CriticBatch) -> torch.Tensor:
    """The reference: one right-padded forward pass of the whole batch, V(s_t) = head(hidden of token t - 1)."""
    hidden = critic.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    values = critic.model.value_head(hidden).squeeze(-1)
    return torch.nn.functional.pad(values[:, :-1], (1, 0)) * batch.loss_mask


LAYOUTS = [
    dict(sequence_packing=False, share_prompts=False),
    dict(sequence_packing=True, share_prompts=False),
    dict(sequence_packing=True, share_prompts=True),
    dict(micro_batch_size=2, sequence_packing=True, share_prompts=False),
    dict(micro_batch_tokens=24, sequence_packing=True, share_prompts=True),
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=["padded", "packed", "shared_prompts", "micro_batches_of_2", "token_budget_24"]
)
def test_values_in_every_micro_batch_layout_equal_the_padded_one_batch_values(tiny_model_dir, layout):
    batch = ragged_batch()
    critic = make_critic(tiny_model_dir, **layout)
    values = critic.values(batch)
    with torch.no_grad():
        expected = padded_values(critic, batch)
    assert expected.abs().max() > 0
    assert (values - expected).abs().max() <= 1e-5
    assert (values * (1 - batch.loss_mask)).abs().max() == 0  # 0 off the mask


def test_a_new_critic_values_everything_at_zero(tiny_model_dir):
    critic = critic_backend(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TrainingConfig(micro_batch_size=8, global_batch_size=8),
        OptimizerConfig(),
        SchedulerConfig(),
        num_optimizer_steps=1,
    )
    assert critic.values(ragged_batch()).abs().max() == 0


@pytest.mark.parametrize("layout", LAYOUTS[2:], ids=["shared_prompts", "micro_batches_of_2", "token_budget_24"])
def test_micro_batched_value_gradients_equal_the_one_batch_gradient(tiny_model_dir, layout):
    batch = ragged_batch()
    grads = []
    for settings in (LAYOUTS[0], layout):
        critic = make_critic(tiny_model_dir, **settings)
        noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
        batch.old_values = (critic.values(batch) + noise) * batch.loss_mask  # near V: some tokens clip, some do not
        critic.optimizer.zero_grad()
        metrics = critic.accumulate_gradients(batch, make_value_loss_fn(0.2))
        assert 0 < metrics["value_clip_fraction"] < 1
        grads.append(torch.cat([p.grad.flatten() for p in critic.model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    assert (grads[1] - grads[0]).abs().max() <= 1e-5 * grads[0].abs().max()  # float32 rounding of sums in another order


def test_the_critic_fits_the_returns_and_a_checkpoint_repeats_the_next_step(tiny_model_dir, tmp_path):
    batch = ragged_batch()
    batch.returns = 2.0 * batch.loss_mask  # every valid token's return is 2
    critic = make_critic(tiny_model_dir)
    loss_fn = make_value_loss_fn(None)
    losses = [critic.train_step(batch, loss_fn)["value_loss"] for _ in range(15)]
    assert losses[-1] < 0.2 * losses[0], losses
    critic.save_state(tmp_path / "critic")
    after_save = critic.train_step(batch, loss_fn)
    restored = make_critic(tiny_model_dir)
    restored.load_state(tmp_path / "critic")
    assert restored.train_step(batch, loss_fn) == after_save
    assert torch.equal(restored.values(batch), critic.values(batch))
    assert "value_head.weight" in model_state_dict(tmp_path / "critic")
    # the critic's trunk is its own copy: the base model on disk is untouched
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(base.model.embed_tokens.weight, critic.model.model.embed_tokens.weight)
