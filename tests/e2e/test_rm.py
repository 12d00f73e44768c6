"""A Bradley-Terry reward model trained on the demo pairs, then served the ordinary ways: the judge
environment's local mode must rank held-out chosen replies above rejected ones as training measured."""

import json

import torch

from reinforge.algorithms import rm
from reinforge.config.loader import load_recipe_config
from reinforge.data.preference import read_preference_records, tokenize_for_reward_model
from reinforge.envs.base import EnvRequest
from reinforge.envs.judge import JudgeEnv, JudgeEnvConfig
from reinforge.envs.reward_model_server import RewardModelScorer
from reinforge.loops.supervised import train
from reinforge.paths import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "configs" / "rm_demo.yaml"
NUM_VAL_PAIRS = 100


def test_reward_model_learns_the_demo_preferences_and_scores_them_the_same_through_the_judge_env(tmp_path):
    config = load_recipe_config(
        rm.RMRunConfig,
        CONFIG,
        [
            "rm.max_steps=50",
            "rm.val_every=0",
            f"data.max_val_pairs={NUM_VAL_PAIRS}",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(config, rm.RM)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(51))
    assert all(
        key in rows[-1] for key in ("train/loss", "train/preference_accuracy", "train/reward_margin", "train/grad_norm")
    )
    first, last = result.first_val, result.last_val
    assert last["val/preference_accuracy"] >= first["val/preference_accuracy"] + 0.2, (first, last)
    assert last["val/loss"] < first["val/loss"] and last["val/reward_margin"] > first["val/reward_margin"]

    # The saved model scores through the judge environment's local mode (as it would in a GRPO run)...
    final = result.run_dir / "final"
    records = read_preference_records(str(PROJECT_ROOT / config.data.val_path), None)[:NUM_VAL_PAIRS]
    judge = JudgeEnv(JudgeEnvConfig(mode="local", local_model_path=str(final), batch_size=16))

    def rewards(reply: str) -> list[float]:
        requests = [
            EnvRequest(messages=r.messages + [{"role": "assistant", "content": getattr(r, reply)}], record={})
            for r in records
        ]
        return [response.reward for response in judge.step(requests)]

    chosen, rejected = rewards("chosen"), rewards("rejected")
    judged_accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(records)
    # ...and ranks the held-out pairs as training measured them (ties aside, which float rounding may break)
    assert abs(judged_accuracy - last["val/preference_accuracy"]) <= 0.02, (judged_accuracy, last)
    assert judged_accuracy >= first["val/preference_accuracy"] + 0.2

    # The scorer renders a conversation into exactly the tokens the reward model was trained on.
    scorer = RewardModelScorer(str(final), device="cpu", dtype="float32", max_length=2048, batch_size=1)
    pair = tokenize_for_reward_model(records[0], scorer.tokenizer)
    with torch.no_grad():
        trained_reward = scorer.model(input_ids=torch.tensor([pair.chosen_ids])).logits[0, 0].item()
    assert abs(trained_reward - chosen[0]) < 1e-4
