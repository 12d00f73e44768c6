"""The mixture-of-experts demo model (models/moe_demo), built by scripts/build_moe_demo_model.py."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "moe_demo"


def test_committed_model_is_a_small_qwen3_moe_with_8_experts_top_2_on_the_demo_tokenizer():
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    config = model.config
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (
        128,
        4,
        2,
        64,
    )
    assert config.tie_word_embeddings and model.dtype == torch.float32
    assert not config.output_router_logits  # the SFT-time balance loss is off in the saved config
    assert (
        AutoTokenizer.from_pretrained(MODEL_DIR).get_vocab()
        == AutoTokenizer.from_pretrained(ROOT / "models" / "demo").get_vocab()
    )
    assert sum(path.stat().st_size for path in MODEL_DIR.iterdir()) < 10 * 2**20


def test_committed_routers_were_trained_to_spread_tokens_over_every_expert():
    """A zero (untrained) router would tie all experts; a trained one sends some tokens to each of the 8."""
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = "23 + 48 = 71. 71 - 15 = 56. The answer is \\boxed{56}. Ann has 23 coins. She finds 48 more."
    with torch.no_grad():
        outputs = model(**tokenizer(text, return_tensors="pt"), output_router_logits=True)
    for logits in outputs.router_logits:
        assert logits.std(dim=-1).min() > 0
    chosen = torch.cat([logits.topk(2, dim=-1).indices.reshape(-1) for logits in outputs.router_logits])
    assert set(chosen.tolist()) == set(range(8))


def test_quick_build_writes_a_loadable_moe_model_and_its_card(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_moe_demo_model.py"), "--quick", "--out", str(tmp_path / "m")],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "qwen3_moe"
    card = (tmp_path / "m" / "README.md").read_text()
    assert "8 experts" in card and "active per token" in card
    assert (
        json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_token_id
    )
