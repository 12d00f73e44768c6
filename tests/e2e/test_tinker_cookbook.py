"""tinker-cookbook's own minimal loops (`tinker_cookbook.recipes.sl_loop` and `rl_loop`), unchanged, against a
reinforge Tinker server on the demo: configs/tinker_cookbook.yaml serves models/tinker_demo under a name the cookbook
knows, and scripts/run_tinker_cookbook.py runs each recipe in a process of its own with the demo's data where the
recipe's `load_dataset` calls look and the demo tokenizer in the cookbook's registry. Only the recipes' own
command-line fields are set (sizes, steps, learning rate, the loss). sl_loop's train_mean_nll falls; rl_loop's
reward rises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from run_tinker_cookbook import cookbook_server, run  # noqa: E402
from tinker_cookbook_data import RL_DATASET  # noqa: E402

pytestmark = pytest.mark.xdist_group("tinker")

SL_FIELDS = ["batch_size=32", "max_steps=10", "lora_rank=16", "learning_rate=2e-3"]
RL_FIELDS = [
    *("batch_size=8", "group_size=8", "max_tokens=40", "max_steps=8"),
    *("lora_rank=16", "learning_rate=1e-3"),  # the recipe's default loss, stable_reinforce
]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with cookbook_server(tmp_path_factory.mktemp("tinker_cookbook_server")) as url:
        yield url


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tinker_cookbook")


def test_sl_loop_lowers_the_loss(server_url, work_dir):
    rows, _ = run("sl_loop", server_url, work_dir, SL_FIELDS, timeout_s=240)
    nll = [row["train_mean_nll"] for row in rows]
    assert len(nll) == 10, rows
    assert sum(nll[-3:]) / 3 < 0.8 * sum(nll[:3]) / 3, nll
    assert (work_dir / "sl_loop" / "checkpoints.jsonl").exists()  # the recipe's final save_state and sampler weights


def test_rl_loop_raises_the_reward(server_url, work_dir):
    # every batch the same 8 problems (the data's choice, not the recipe's): a rise within a few steps
    rows, _ = run("rl_loop", server_url, work_dir, RL_FIELDS, timeout_s=300, options=("--rl-problems", "8"))
    rewards = [row["reward/total"] for row in rows]
    assert len(rewards) == 8, rows
    assert (work_dir / "data" / RL_DATASET / "train.jsonl").exists()
    assert 0.05 < rewards[0] < 0.9, rewards  # the model answers rl_loop's prompt, with room to improve
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.05, rewards
