"""Reasoning control end to end, as in Llama-Nemotron (arXiv:2505.00949): SFT the demo model on
"detailed thinking on/off" chats, then GRPO from the SFT's model with the math reward plus the `format`
reward; the policy must follow the system prompt's switch in both modes.

A shortened run of configs/reasoning_sft_demo.yaml and configs/reasoning_grpo_demo.yaml that fits CI
(50-70 s on 2 shared CPU cores): SFT for 120 steps of 16 chats at twice the demo's learning rate (the switch
is learned by about step 100, the arithmetic is not won back), then 3 GRPO steps of 16 prompts x 8.
The full demo's numbers are in docs/algorithms.md.
"""

import json

import pytest
import yaml

from reinforge import loops
from reinforge.algorithms import sft
from reinforge.algorithms.grpo_config import load_config
from reinforge.config.loader import load_recipe_config
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.envs.base import EnvRequest
from reinforge.envs.format_env import FormatEnv, FormatEnvConfig
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.loops.supervised import train
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.recipes.spec import load_recipe
from reinforge.recipes.stages import build_stages

CONFIGS = PROJECT_ROOT / "configs"
ON, OFF = "compliance_rate/thinking_on", "compliance_rate/thinking_off"
SFT_OVERRIDES = [
    "sft.max_steps=120",
    "training.global_batch_size=16",
    "optimizer.lr=2e-3",
    "scheduler.warmup_steps=5",
    "data.val_fraction=0",
    "cluster.num_threads=1",
]
GRPO_OVERRIDES = [
    "loop.max_steps=3",
    "loop.val_every=0",
    "rollout.num_prompts_per_step=16",
    "data.max_val_prompts=64",
    "cluster.num_threads=1",
    "checkpoint.save_final=false",
]


def greedy_compliance(model_dir, num_prompts: int) -> dict[str, float]:
    """The format environment's compliance rates of one greedy answer to each of the first prompts of
    data/demo/reasoning_val.jsonl (half "on", half "off")."""
    config = ModelConfig(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(config)
    engine = HFGenerationBackend(load_model(config), tokenizer, max_batch_size=num_prompts)
    records = read_jsonl(PROJECT_ROOT / "data" / "demo" / "reasoning_val.jsonl")[:num_prompts]
    prompts = [render_prompt(record, tokenizer, "prompt", None, use_chat_template=True) for record in records]
    result = engine.generate(
        [p.token_ids for p in prompts], SamplingParams(max_new_tokens=64, temperature=0.0, num_samples=1)
    )
    env = FormatEnv(FormatEnvConfig())
    env.step(
        [
            EnvRequest(
                messages=p.messages
                + [{"role": "assistant", "content": tokenizer.decode(c.token_ids, skip_special_tokens=True)}],
                record=p.record,
            )
            for p, (c,) in zip(prompts, result.completions)
        ]
    )
    return env.metrics()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The SFT run, then the GRPO run started from its final model; both real, in this process."""
    root = tmp_path_factory.mktemp("reasoning_control")
    sft_config = load_recipe_config(
        sft.SFTRunConfig, CONFIGS / "reasoning_sft_demo.yaml", SFT_OVERRIDES + [f"logging.run_dir={root / 'sft'}"]
    )
    sft_run = train(sft_config, sft.SFT).run_dir
    grpo_config = load_config(
        CONFIGS / "reasoning_grpo_demo.yaml",
        GRPO_OVERRIDES + [f"model.name_or_path={sft_run / 'final'}", f"logging.run_dir={root / 'grpo'}"],
    )
    grpo_run = loops.train(grpo_config).run_dir
    rows = [json.loads(line) for line in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    return sft_run, grpo_run, rows


def test_the_demo_model_alone_never_thinks_on_request():
    """The starting point: models/demo has never seen a system message or a <think> tag."""
    rates = greedy_compliance(PROJECT_ROOT / "models" / "demo", num_prompts=32)
    assert rates[ON] == 0.0 and rates[OFF] == 1.0, rates


def test_grpo_starts_from_the_sft_model(chain):
    sft_run, grpo_run, rows = chain
    saved = yaml.safe_load((grpo_run / "config.yaml").read_text())
    assert saved["model"]["name_or_path"] == str(sft_run / "final")
    # step 0 validates the starting weights: they think on request, which models/demo never does
    assert rows[0]["step"] == 0 and rows[0][f"val/env/format/{ON}"] >= 0.9, rows[0]


def test_after_sft_and_grpo_the_policy_follows_the_switch_in_both_modes(chain):
    _, _, rows = chain
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    final = rows[-1]
    assert final[f"val/env/format/{ON}"] >= 0.9 and final[f"val/env/format/{OFF}"] >= 0.9, final
    assert final["val/env/format/no_switch"] == 0  # every validation prompt carried its mode
    for row in rows[1:]:
        # sampled at temperature 1, GRPO's own rollouts keep to the switch: the format reward never
        # trades one mode for the other (which a half-learned switch was seen to do)
        assert row[f"env/format/{ON}"] >= 0.7 and row[f"env/format/{OFF}"] >= 0.7, row
        assert row["train/math/format_mean"] >= 0.7, row  # the extra reward reached the trajectories


def test_the_recipe_chains_the_two_demo_configs(tmp_path):
    """configs/recipes/reasoning_control_demo.yaml: the same two configs, GRPO from the SFT stage's weights."""
    path = CONFIGS / "recipes" / "reasoning_control_demo.yaml"
    sft_stage, grpo_stage = build_stages(load_recipe(path), path, tmp_path / "run")
    assert (sft_stage.algorithm, grpo_stage.algorithm) == ("sft", "grpo")
    assert grpo_stage.config.model.name_or_path == str(sft_stage.run_dir / "final")
    demo = load_config(CONFIGS / "reasoning_grpo_demo.yaml")
    assert grpo_stage.config.env.extra_rewards == demo.env.extra_rewards == {"format": 0.5}
    assert grpo_stage.config.data == demo.data
    assert sft_stage.config.data == load_recipe_config(sft.SFTRunConfig, CONFIGS / "reasoning_sft_demo.yaml").data


def test_gdpo_normalises_the_math_and_format_rewards_apart_from_the_sft_model(chain, tmp_path):
    """configs/gdpo_demo.yaml for 2 steps from the same SFT model: two reward components (math's task reward and
    0.5 x format), each normalised in its group, the sum whitened over the trained tokens (mean 0, std 1);
    the policy keeps the switch it started with."""
    sft_run, _, _ = chain
    config = load_config(
        CONFIGS / "gdpo_demo.yaml",
        GRPO_OVERRIDES
        + ["loop.max_steps=2", f"model.name_or_path={sft_run / 'final'}", f"logging.run_dir={tmp_path / 'gdpo'}"],
    )
    assert config.grpo.decoupled_normalization and config.env.extra_rewards == {"format": 0.5}
    rows = [json.loads(line) for line in (loops.train(config).run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert row["train/num_reward_components"] == 2.0, row
        assert abs(row["train/advantage_token_mean"]) < 1e-5 and abs(row["train/advantage_token_std"] - 1.0) < 1e-3, row
    # The SFT model starts at 30 to 32 of the 32 "on" prompts (which of them depends on float rounding over its
    # 120 steps: the code of 2026-12-01 and the one before it agree to 3e-8 after a step, then drift apart); two
    # GDPO steps keep that, to two prompts, in both modes.
    start, end = rows[0], rows[-1]
    for mode in (ON, OFF):
        assert end[f"val/env/format/{mode}"] >= start[f"val/env/format/{mode}"] - 2 / 32 - 1e-9, (start, end)
