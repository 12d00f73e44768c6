"""Every recipe trains a mixture-of-experts model: a tiny random Qwen3-MoE on the demo tokenizer runs GRPO (router
replay from the HF engine's recorded routes), PPO (its critic an MoE too), distillation (the MoE the student of
models/demo_teacher, same tokenizer), SFT, DPO, RM and LoRA SFT for a couple of optimizer steps each, through the
same in-process entries as the demo e2e tests, with finite losses and the MoE metrics logged. The LoRA run's
adapter, merged by `reinforge convert --merge`, loads back with from_pretrained (experts unfused on disk, as
transformers writes them) to the logits of the base model plus the adapter."""

import json
import math
import shutil

import peft
import pytest
import torch
from conftest import build_tiny_moe
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from reinforge.config.loader import load_recipe_config
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.loops.registry import RECIPES
from reinforge.paths import PROJECT_ROOT
from reinforge.training.convert import convert

DEMO = PROJECT_ROOT / "models" / "demo"
CONFIGS = PROJECT_ROOT / "configs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MOE_METRICS = ("train/moe/load_cv", "train/moe/router_entropy")

# RL recipes: 2 loop steps of 4 prompts x 4 answers of at most 16 tokens, one optimizer step each, no validation
RL_SMALL = [
    "loop.max_steps=2",
    "loop.val_every=0",
    "data.val_path=null",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "training.global_batch_size=16",
    "training.micro_batch_size=16",
    "generation.max_new_tokens=16",
    "generation.num_probe_prompts=2",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
    # a random model never answers right: a reward it earns in varied amounts gives nonzero advantages
    "env.custom.digits=test_moe_recipes:DigitShareEnv",
    "env.extra_rewards.digits=1.0",
]
PAIR_SMALL = ["data.max_val_pairs=8", "training.global_batch_size=16", "training.micro_batch_size=16"]
SFT_SMALL = ["sft.max_steps=2", "sft.val_every=0", "training.global_batch_size=8", "cluster.num_threads=1"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A 2-layer random Qwen3-MoE (4 experts, top-2, random routers) on models/demo's tokenizer."""
    path = tmp_path_factory.mktemp("moe_on_demo_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    build_tiny_moe(
        path,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=2048,
    )
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / name, path / name)
    return path


class DigitShareEnv:
    """Pays a response its share of digit characters (0 for a blank one)."""

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        texts = [request.messages[-1]["content"] for request in requests]
        return [EnvResponse(reward=sum(c.isdigit() for c in text) / max(len(text), 1)) for text in texts]

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def assert_experts_unfused_on_disk(model_dir):
    """transformers' on-disk layout: each expert's own gate/up/down projections, never the fused in-memory ones."""
    with safe_open(model_dir / "model.safetensors", "pt") as saved:
        names = set(saved.keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names, sorted(names)[:8]
    assert not any("gate_up_proj" in name for name in names)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# each recipe's demo config, cut down: the registry's every recipe must have an entry (a new one fails here)
RUNS = {
    "grpo": ("grpo_demo.yaml", [*RL_SMALL, "model.moe.router_replay=rollout"]),
    "ppo": ("ppo_demo.yaml", RL_SMALL),
    "distill": ("distill_demo.yaml", RL_SMALL),  # models/demo_teacher (dense, the same tokenizer) the teacher
    "sft": ("sft_demo.yaml", SFT_SMALL),
    "dpo": ("dpo_demo.yaml", [*PAIR_SMALL, "dpo.max_steps=2", "dpo.val_every=0"]),
    "rm": ("rm_demo.yaml", [*PAIR_SMALL, "rm.max_steps=2", "rm.val_every=0"]),
}


def train(name: str, config_file: str, overrides: list[str]):
    """Recipe `name` run in this process, as `reinforge NAME --config configs/CONFIG_FILE OVERRIDES` runs it."""
    recipe = RECIPES[name]
    return recipe.train(load_recipe_config(recipe.config_class, CONFIGS / config_file, overrides))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_the_moe_with_its_routing_metrics(recipe, moe_dir, tmp_path):
    run_dir = tmp_path / "run"
    config_file, overrides = RUNS[recipe]
    train(recipe, config_file, [*overrides, f"model.name_or_path={moe_dir}", f"logging.run_dir={run_dir}"])
    steps = [row for row in rows(run_dir) if row["step"] > 0 and "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0
        assert all(key in row for key in MOE_METRICS), sorted(row)
    if recipe in ("grpo", "ppo"):  # the HF engine samples what the trainer computes
        assert all(abs(row["train/token_mult_prob_error"] - 1) < 1e-3 for row in steps)
    if recipe == "grpo":  # every trained token forced onto the experts the engine routed it (in float32, alike)
        assert all(row["train/moe/replayed_share"] == 1.0 for row in steps)
        assert all(0 <= row["train/moe/router_disagreement"] <= 0.05 for row in steps)
    if recipe == "ppo":  # the critic is an MoE too
        assert all("train/critic_moe/load_cv" in row and row["train/value_loss"] > 0 for row in steps)
    if (run_dir / "final").is_dir():  # sft, dpo and rm save their final model
        assert_experts_unfused_on_disk(run_dir / "final")
    if recipe == "rm":  # the MoE with a scalar score head, saved as transformers' own class
        assert AutoConfig.from_pretrained(run_dir / "final").architectures == ["Qwen3MoeForSequenceClassification"]


def test_lora_sft_adapts_the_moe_attention_and_its_merged_export_loads_back_to_the_same_logits(moe_dir, tmp_path):
    """all-linear on an MoE adapts the attention projections only; `convert --merge` writes the merged model with
    transformers' unfused per-expert weights, and from_pretrained fuses them back to the adapted model's logits."""
    common = [f"model.name_or_path={moe_dir}", f"logging.run_dir={tmp_path / 'run'}"]
    result = train("sft", "sft_lora_demo.yaml", [*SFT_SMALL, *common])
    steps = [row for row in rows(result.run_dir) if "train/loss" in row]
    assert len(steps) == 2 and all(key in row for row in steps for key in MOE_METRICS)
    final = result.run_dir / "final"
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe_dir), final)
    lora_modules = {name.rsplit(".", 1)[0] for name, _ in adapted.named_parameters() if "lora_" in name}
    assert lora_modules and all(".self_attn." in name for name in lora_modules), sorted(lora_modules)[:4]

    merged_dir = convert(final, tmp_path / "merged", merge=True)
    assert_experts_unfused_on_disk(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert isinstance(merged, Qwen3MoeForCausalLM)
    input_ids = torch.tensor([AutoTokenizer.from_pretrained(merged_dir)("12 + 30 = 42. The answer is 42.").input_ids])
    with torch.no_grad():
        expected, exported = adapted(input_ids=input_ids).logits, merged(input_ids=input_ids).logits
        base = AutoModelForCausalLM.from_pretrained(moe_dir)(input_ids=input_ids).logits
    assert (exported - expected).abs().max() < 1e-4
    assert (exported - base).abs().max() > 1e-3  # the adapter moved the model
