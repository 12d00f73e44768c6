"""One PPO step (algorithms/ppo.train_on_batch) on hand-made rollouts with the real trainer and critic: the
update order changes no number, the critic's warm-up leaves the policy untouched, and the advantages the
actor trains on are GAE's, whitened over the batch's tokens."""

from functools import partial
from types import SimpleNamespace

import torch

from reinforge.algorithms import ppo
from reinforge.algorithms.learner import LearnerParts
from reinforge.algorithms.ppo_config import PPORunConfig
from reinforge.config.loader import load_recipe_config
from reinforge.data.batch import Trajectory
from reinforge.logging.metrics import Timers
from reinforge.loops.builders import build_critic
from reinforge.model_config import ModelConfig
from reinforge.rollout.source import RolloutBatch
from reinforge.training.backend import Backend
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import SchedulerConfig


def rollouts() -> RolloutBatch:
    """4 prompts x 2 samples of random tokens, rewards 1 and 0 alternating."""
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(8):
        prompt = torch.randint(2, 64, (3 + row // 2,), generator=gen).tolist()
        response = torch.randint(2, 64, (2 + row % 5,), generator=gen).tolist()
        trajectories.append(
            Trajectory(prompt, response, [0.0] * len(response), False, float(row % 2), row // 2, "math")
        )
    return RolloutBatch(step=1, trajectories=trajectories, metrics={}, policy_version=0)


def step(model_dir, *overrides: str) -> tuple[dict[str, float], bool, Backend, Backend]:
    """One step of a fresh policy and critic on `rollouts()`: (metrics without timings, whether the policy changed,
    the policy's trainer, the critic)."""
    config = load_recipe_config(
        PPORunConfig,
        None,
        [
            f"model.name_or_path={model_dir}",
            "rollout.num_prompts_per_step=4",
            "rollout.num_generations_per_prompt=2",
            "training.global_batch_size=4",
            "training.micro_batch_size=4",
            "optimizer.lr=1e-3",
            "ppo.critic_lr=1e-2",
            *overrides,
        ],
    )
    trainer = fresh_policy(config)
    critic = partial(build_critic, config, cleanup=None)  # the loop's builder: in this process on the torch backend
    learner = ppo.ppo_learner(config, LearnerParts(trainer, SimpleNamespace(pad_token_id=0), None, critic))
    result = learner.train_on_batch(1, rollouts(), Timers())
    return (
        {k: v for k, v in result.metrics.items() if not k.startswith(("timing/", "perf/"))},
        result.trained,
        trainer,
        learner.models["critic"],
    )


def fresh_policy(config) -> Backend:
    torch.manual_seed(0)
    return Backend(
        config.model,
        config.training,
        config.optimizer,
        SchedulerConfig(),
        num_optimizer_steps=4,
        head=LogprobHead(1.0),
        load_reference=False,
    )


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_critic_before_or_after_the_actor_gives_the_same_step(tiny_model_dir):
    first, trained, trainer, critic = step(tiny_model_dir, "ppo.critic_first=true")
    second, _, other_trainer, other_critic = step(tiny_model_dir, "ppo.critic_first=false")
    assert trained and first == second
    assert (
        first["train/num_optimizer_steps"] == 2 and first["train/critic_num_optimizer_steps"] == 2
    )  # 8 rollouts, batches of 4
    assert torch.equal(weights(trainer.model), weights(other_trainer.model))
    assert torch.equal(weights(critic.model), weights(other_critic.model))


def test_during_the_critic_warm_up_only_the_critic_trains(tiny_model_dir):
    metrics, trained, trainer, critic = step(tiny_model_dir, "ppo.critic_warmup_steps=1")
    assert not trained and metrics["train/num_optimizer_steps"] == 0 and "train/loss" not in metrics
    untouched = Backend(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        trainer.config,
        trainer.optimizer_config,
        SchedulerConfig(),
        num_optimizer_steps=4,
        head=LogprobHead(1.0),
        load_reference=False,
    )
    assert torch.equal(weights(trainer.model), weights(untouched.model))
    assert metrics["train/critic_num_optimizer_steps"] == 2 and critic.model.value_head.bias.item() != 0


def test_the_actor_trains_on_whitened_gae_advantages(tiny_model_dir):
    """A new critic values every state 0, so with gamma = lambda = 1 each token's GAE advantage is its sequence's
    reward (1 or 0); whitened over the n = 29 tokens they have mean 0 and Bessel-corrected std 1, so the logged
    population std is sqrt(28 / 29) = 0.98261, and the returns are the rewards."""
    metrics, _, _, _ = step(tiny_model_dir, "ppo.lam=1.0")
    assert metrics["train/explained_variance"] == 0 and metrics["train/rollout_value_mean"] == 0
    lengths = [2 + row % 5 for row in range(8)]
    num_tokens = sum(lengths)
    assert abs(metrics["train/advantage_token_mean"]) < 1e-6
    assert abs(metrics["train/advantage_token_std"] - ((num_tokens - 1) / num_tokens) ** 0.5) < 1e-4
    assert metrics["train/gae_advantage_mean"] == metrics["train/return_mean"]
    expected = sum(n for row, n in enumerate(lengths) if row % 2) / sum(lengths)  # the fraction of tokens with reward 1
    assert abs(metrics["train/return_mean"] - expected) < 1e-6
