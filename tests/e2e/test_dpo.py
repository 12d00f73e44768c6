"""DPO on the embedded demo model and its preference pairs: the held-out margin and accuracy must rise."""

import json
import math

import torch
from transformers import AutoModelForCausalLM

from reinforge.algorithms import dpo
from reinforge.cli import main
from reinforge.config.loader import load_recipe_config
from reinforge.loops.supervised import train
from reinforge.paths import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "configs" / "dpo_demo.yaml"
REQUIRED = [
    "train/loss",
    "train/dpo_loss",
    "train/sft_loss",
    "train/reward_margin",
    "train/preference_accuracy",
    "train/chosen_reward",
    "train/rejected_reward",
    "train/chosen_logp",
    "train/rejected_logp",
    "train/logp_accuracy",
    "train/grad_norm",
    "train/lr",
    "train/epoch",
    "timing/step_s",
    "timing/reference_s",
    "timing/train_s",
    "perf/tokens_per_s",
]


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dpo_on_the_demo_pairs_raises_the_held_out_margin_and_preference_accuracy(tmp_path):
    config = load_recipe_config(
        dpo.DPORunConfig,
        CONFIG,
        ["dpo.max_steps=12", "dpo.val_every=0", "data.max_val_pairs=64", f"logging.run_dir={tmp_path / 'run'}"],
    )
    result = train(config, dpo.DPO)
    rows = read_rows(result.run_dir)
    assert [row["step"] for row in rows] == list(range(13))
    for row in rows[1:]:
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, missing
    # before any update the policy is the reference: every implicit reward is 0 and the loss is log 2
    assert abs(rows[1]["train/loss"] - math.log(2)) < 1e-5 and abs(result.first_val["val/loss"] - math.log(2)) < 1e-5
    first, last = result.first_val, result.last_val
    assert last["val/reward_margin"] > first["val/reward_margin"] + 0.05, (first, last)
    assert last["val/preference_accuracy"] >= first["val/preference_accuracy"] + 0.2, (first, last)
    assert last["val/logp_accuracy"] > first["val/logp_accuracy"] + 0.2, (
        first,
        last,
    )  # the policy itself now prefers the chosen replies
    assert last["val/chosen_reward"] > last["val/rejected_reward"]
    # the run directory's config.yaml reproduces the run
    assert load_recipe_config(dpo.DPORunConfig, result.run_dir / "config.yaml").dpo == config.dpo
    trained = AutoModelForCausalLM.from_pretrained(result.run_dir / "final")
    start = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "demo")
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))


def test_precomputed_reference_logprobs_give_the_same_run_as_a_frozen_reference_model(tmp_path):
    pairs = (PROJECT_ROOT / "data" / "demo" / "preference_train.jsonl").read_text().splitlines()[:24]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(pairs) + "\n")
    common = [
        "dpo.max_steps=3",
        "dpo.val_every=0",
        "data.val_path=null",
        f"data.train_path={data}",
        "checkpoint.save_final=false",
        "training.global_batch_size=16",
        "training.micro_batch_size=8",
        "dpo.sft_weight=0.5",
    ]
    losses = {}
    for mode in ("per_batch", "precompute"):
        config = load_recipe_config(
            dpo.DPORunConfig, CONFIG, common + [f"dpo.reference={mode}", f"logging.run_dir={tmp_path / mode}"]
        )
        losses[mode] = [
            (row["train/loss"], row["train/reward_margin"]) for row in read_rows(train(config, dpo.DPO).run_dir)
        ]
    assert len(losses["precompute"]) == 3
    for (loss_a, margin_a), (loss_b, margin_b) in zip(losses["per_batch"], losses["precompute"]):
        assert abs(loss_a - loss_b) < 1e-5 and abs(margin_a - margin_b) < 1e-5, losses


def test_the_dpo_command_reports_config_errors_on_one_line(tmp_path, capsys):
    """cli.main in this process (cluster.max_restarts=0: no supervised child; the supervisor relays the same line:
    tests/e2e/test_cli.py)."""
    assert main(["dpo", "--config", str(CONFIG), "dpo.betta=0.2", "cluster.max_restarts=0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "reinforge: error: unknown config key dpo.betta: reinforge dpo has no such setting; did you mean dpo.beta?"
    )
