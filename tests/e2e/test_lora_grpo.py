"""GRPO with LoRA end to end: the demo learns with adapters only, and a LoRA run killed after step 2
resumes to the metrics of a run never killed."""

import json
import sys

import peft
import torch
from _kill import assert_resumes_like_a_run_never_killed
from transformers import AutoModelForCausalLM

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.paths import PROJECT_ROOT
from reinforge.training.state import model_state_dict

CONFIG = PROJECT_ROOT / "configs" / "grpo_lora_demo.yaml"


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_lora_raises_reward_and_accuracy_and_leaves_an_adapter(tmp_path):
    config = load_config(CONFIG, ["loop.max_steps=12", "loop.val_every=0", f"logging.run_dir={tmp_path / 'run'}"])
    result = loops.train(config)
    steps = rows(result.run_dir)[1:]
    early = sum(r["train/reward_mean"] for r in steps[:4]) / 4
    late = sum(r["train/reward_mean"] for r in steps[-4:]) / 4
    assert late > early, (early, late)
    assert result.last_val_accuracy >= result.first_val_accuracy + 0.05, (
        result.first_val_accuracy,
        result.last_val_accuracy,
    )
    assert all(r["train/token_mult_prob_error"] < 1.001 and r["train/kl"] >= 0 for r in steps)
    assert steps[-1]["train/kl"] > 0  # the reference (adapters off) differs from the policy
    # final/ is a PEFT adapter on the demo model; loaded the ordinary way, it is the trained policy, not the base
    final = result.run_dir / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "demo")
    trained = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "demo"), final
    )
    ids = torch.tensor([[1, 30, 31, 32, 33, 34]])
    assert not torch.allclose(trained(input_ids=ids).logits, base(input_ids=ids).logits)
    # a run started from the base plus that adapter (model.adapter, merged at load) begins where this one ended
    onward = load_config(
        CONFIG,
        ["loop.max_steps=0", "model.lora=null", f"model.adapter={final}", f"logging.run_dir={tmp_path / 'onward'}"],
    )
    assert loops.train(onward).first_val_accuracy == result.last_val_accuracy


RESUME = [
    "loop.max_steps=4",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "checkpoint.resume=auto",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=40",
    "data.max_val_prompts=8",
    "loop.val_every=2",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
]


def command(run_dir):
    return [
        sys.executable,
        "-m",
        "reinforge.cli",
        "grpo",
        "--config",
        str(CONFIG),
        *RESUME,
        f"logging.run_dir={run_dir}",
    ]


def test_a_lora_run_killed_after_step_2_resumes_to_the_metrics_of_a_run_never_killed(tmp_path):
    assert_resumes_like_a_run_never_killed(command, tmp_path, step=2)
    checkpoint = model_state_dict(tmp_path / "killed" / "checkpoints" / "step_00000004" / "trainer")
    assert checkpoint and all("lora_" in name for name in checkpoint)  # the adapter only: small


def test_a_recipe_of_lora_stages_chains_them_through_the_merged_models(tmp_path):
    """Each LoRA stage's final/ is an adapter; the next stage starts from merged/ (its base with the adapter
    merged in), and so does the recipe's last model."""
    from reinforge.recipes.runner import run_recipe

    markers = run_recipe(
        PROJECT_ROOT / "configs" / "recipes" / "demo_progressive.yaml",
        ["model.lora.rank=8", "optimizer.lr=1e-3", "loop.max_steps=1"],
        run_dir=str(tmp_path / "recipe"),
    )
    stages = sorted((tmp_path / "recipe" / "stages").iterdir())
    assert [m["weights"] for m in markers] == [str(stage / "merged") for stage in stages]
    second = json.loads((stages[1] / "stage_complete.json").read_text())
    assert second["config"]["model"]["name_or_path"] == str(stages[0] / "merged")
    # merged/ is stage 1's base with its adapter: the same outputs as PEFT's model of the two
    ids = torch.tensor([[1, 30, 31, 32, 33, 34]])
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "demo"), stages[0] / "final"
    )
    merged = AutoModelForCausalLM.from_pretrained(stages[0] / "merged")
    with torch.no_grad():
        adapter_logits, merged_logits = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    # fp32's rounding of W + (alpha / r) B A against the adapter's separate matmuls: a few units in the last place
    # of the largest logit (1.5e-5 seen at logits near 17); a wrong merge is off by > 1e-3
    tolerance = 8 * torch.finfo(torch.float32).eps * float(adapter_logits.abs().max())
    assert (adapter_logits - merged_logits).abs().max() <= tolerance
