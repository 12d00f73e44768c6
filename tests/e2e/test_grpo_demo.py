"""A short GRPO run on the embedded demo model, with every real component: the reward must rise."""

import json

import torch
from transformers import AutoModelForCausalLM

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.paths import PROJECT_ROOT

REQUIRED = [
    "train/reward_mean",
    "train/reward_std",
    "train/loss",
    "train/kl",
    "train/clip_fraction",
    "train/entropy",
    "train/grad_norm",
    "rollout/gen_len_mean",
    "rollout/truncated_fraction",
    "timing/generate_s",
    "timing/train_s",
    "timing/step_s",
    "perf/tokens_per_s",
    "train/token_mult_prob_error",
]


def test_grpo_on_the_demo_model_raises_reward_and_accuracy(tmp_path):
    config = load_config(
        PROJECT_ROOT / "configs" / "grpo_demo.yaml",
        ["loop.max_steps=12", "loop.val_every=0", f"logging.run_dir={tmp_path / 'run'}"],
    )
    result = loops.train(config)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(13))
    steps = rows[1:]
    for row in steps:
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, missing
        # the HF engine and the trainer compute the same distribution
        assert row["train/token_mult_prob_error"] < 1.001
    early = sum(r["train/reward_mean"] for r in steps[:4]) / 4
    late = sum(r["train/reward_mean"] for r in steps[-4:]) / 4
    assert late > early, (early, late)
    assert result.last_val_accuracy >= result.first_val_accuracy + 0.05, (
        result.first_val_accuracy,
        result.last_val_accuracy,
    )
    # the trained policy is a Hugging Face model that loads the ordinary way and differs from the start
    trained = AutoModelForCausalLM.from_pretrained(result.run_dir / "final")
    start = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "demo")
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))
