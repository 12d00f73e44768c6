"""PPO's critic on FSDP2 ranks (training/critic.py with an `FSDP2Strategy`) with real torch.distributed (gloo) in
real processes: two ranks give the torch critic's values, value-loss gradients and updated weights, and a sharded
checkpoint round trip repeats the next step exactly.

One world of 2 ranks runs the script once (module fixture: spawning the processes is the expensive part).
Its head starts at zero, so the first step trains the head alone (the trunk's gradient is 0 through a zero
head); the gradients compared are those after it, when the trunk's are not 0.
"""

import pytest
import torch
from test_critic import ragged_batch
from test_fsdp2_worker import launch

from reinforge.algorithms.ppo import make_value_loss_fn
from reinforge.model_config import ModelConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.critic import critic_backend
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

NUM_STEPS = 3
TRAINING = dict(micro_batch_size=2, global_batch_size=8)
OPTIMIZER = OptimizerConfig(lr=1e-2)
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def script(critic, batch, gathered_grads, save, load):
    """What both critics run: NUM_STEPS clipped-value-loss steps, the values before and after each and the full
    gradient after the first; with `save`/`load` the state after step NUM_STEPS - 1 is saved, the last step
    taken, the state loaded and the last step taken again."""
    loss_fn = make_value_loss_fn(0.2)
    result = {"values": [critic.values(batch)], "metrics": []}
    for step in range(1, NUM_STEPS + 1):
        if step == 2:
            critic.optimizer.zero_grad(set_to_none=True)
            critic.accumulate_gradients(batch, loss_fn)
            result["grads"] = gathered_grads(critic)
        if step == NUM_STEPS and save is not None:
            save(critic)
        result["metrics"].append(critic.train_step(batch, loss_fn))
        result["values"].append(critic.values(batch))
    if load is not None:
        load(critic)
        result["repeated"] = critic.train_step(batch, loss_fn), critic.values(batch)
    return result


def run_critic_rank(rank, world_size, port, model_dir, out_dir):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    critic = critic_backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(**TRAINING),
        OPTIMIZER,
        SchedulerConfig(),
        num_optimizer_steps=10,
        strategy=FSDP2Strategy(rank, world_size, "127.0.0.1", port),
    )
    state = str(out_dir / "critic_state")  # each rank writes its shards
    result = script(
        critic,
        ragged_batch(),
        lambda c: {name: p.grad.full_tensor().cpu() for name, p in c.model.named_parameters() if p.grad is not None},
        save=lambda c: c.save_state(state),
        load=lambda c: c.load_state(state),
    )
    result["weights"] = dict(critic.named_weights())
    torch.save(result, out_dir / f"rank{rank}.pt")
    critic.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """(the two ranks' results, the torch critic's)."""
    two = launch(2, tiny_model_dir, tmp_path_factory.mktemp("fsdp2_critic"), target=run_critic_rank)
    torch.manual_seed(0)
    critic = critic_backend(
        ModelConfig(name_or_path=str(tiny_model_dir)), TrainingConfig(**TRAINING), OPTIMIZER, SchedulerConfig(), 10
    )
    one = script(
        critic,
        ragged_batch(),
        lambda c: {name: p.grad.clone() for name, p in c.model.named_parameters() if p.grad is not None},
        None,
        None,
    )
    one["weights"] = dict(critic.named_weights())
    return two, one


def test_two_critic_ranks_give_the_torch_critics_values_and_value_loss_metrics(runs):
    two, one = runs
    assert one["values"][0].abs().max() == 0 and one["values"][-1].abs().max() > 0  # a new critic values 0, then learns
    assert 0 < one["metrics"][1]["value_clip_fraction"] < 1
    for rank in range(2):
        for step in range(NUM_STEPS + 1):
            torch.testing.assert_close(two[rank]["values"][step], one["values"][step], atol=1e-5, rtol=0)
        for step in range(NUM_STEPS):
            for name in ("value_loss", "value_clip_fraction", "grad_norm", "lr"):
                assert abs(two[rank]["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (name, step, rank)


def test_two_critic_ranks_give_the_torch_critics_gradients_and_updated_weights(runs):
    two, one = runs
    assert one["grads"].keys() == two[0]["grads"].keys() and "value_head.weight" in one["grads"]
    assert one["grads"]["model.layers.0.mlp.up_proj.weight"].abs().max() > 0  # the trunk learns through the head
    for name, grad in one["grads"].items():
        torch.testing.assert_close(
            two[0]["grads"][name], grad, atol=1e-5 * max(1.0, grad.abs().max().item()), rtol=0, msg=name
        )
    assert one["weights"].keys() == two[0]["weights"].keys()
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two[0]["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def test_a_sharded_critic_checkpoint_repeats_the_next_step_exactly(runs):
    two, _ = runs
    for rank in range(2):
        metrics, values = two[rank]["repeated"]
        assert metrics == two[rank]["metrics"][-1]
        assert torch.equal(values, two[rank]["values"][-1])
