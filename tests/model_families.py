"""The model families of the conformance matrix (docs/models.md): a tiny random model of each, built from
transformers' own config class with the demo's tokenizer (models/demo), its variant settings at values that
matter at the tests' sequence lengths (20-80 tokens): sliding windows of 8 tokens, soft-caps that bind,
attention sinks, query scaling, QK-norm, partial rotary, MLA, hybrid Mamba layers.

`build(name, path)` saves one in Hugging Face format (weights, config, tokenizer, chat template), as a user's
checkpoint would be; every test and scripts/model_matrix.py build them from here.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
VOCAB = 449  # the demo tokenizer's
WINDOW = 8  # sliding windows shorter than every test's sequences
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.1,  # larger than the default 0.02, so soft-caps and windows change the logits visibly
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=2,
)
MOE = dict(num_experts_per_tok=2)


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # transformers' config class
    settings: dict = field(default_factory=dict)
    variants: str = ""  # what of the model's attention or layout the tiny model exercises
    moe: bool = False

    def config(self) -> transformers.PretrainedConfig:
        return getattr(transformers, self.config_class)(**(COMMON | self.settings))


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in [
        Family(
            "llama",
            "LlamaConfig",
            variants="llama3 RoPE scaling",
            settings=dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=10000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
            ),
        ),
        Family("mistral", "MistralConfig", variants=f"sliding window {WINDOW}", settings=dict(sliding_window=WINDOW)),
        Family(
            "qwen2",
            "Qwen2Config",
            variants=f"sliding window {WINDOW} on layers >= max_window_layers=1",
            settings=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        ),
        Family("qwen3", "Qwen3Config", variants="QK-norm", settings=dict(head_dim=32)),
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            moe=True,
            variants="QK-norm, 4 experts top-2",
            settings=MOE
            | dict(
                head_dim=32,
                num_experts=4,
                moe_intermediate_size=32,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        ),
        Family(
            "mixtral",
            "MixtralConfig",
            moe=True,
            variants="4 experts top-2",
            settings=MOE
            | dict(
                num_local_experts=4,
                sliding_window=None,
            ),
        ),
        Family(
            "olmoe",
            "OlmoeConfig",
            moe=True,
            variants="QK-norm over all heads, 4 experts top-2, untied LM head (as OLMoE's own)",
            settings=MOE | dict(num_experts=4, tie_word_embeddings=False),
        ),
        Family(
            "gemma2",
            "Gemma2Config",
            variants=f"attention and final-logit soft-caps, sliding window {WINDOW}, query_pre_attn_scalar",
            settings=dict(
                head_dim=32,
                sliding_window=WINDOW,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        Family(
            "gemma3",
            "Gemma3TextConfig",
            variants=f"local layers with sliding window {WINDOW}, QK-norm, query_pre_attn_scalar, final-logit soft-cap",
            settings=dict(
                head_dim=32,
                sliding_window=WINDOW,
                query_pre_attn_scalar=16,
                final_logit_softcapping=3.0,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        Family(
            "phi3",
            "Phi3Config",
            variants="fused qkv and gate_up projections, partial rotary",
            settings=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
        ),
        Family("olmo2", "Olmo2Config", variants="QK-norm over all heads, norms after attention and MLP"),
        Family(
            "granite",
            "GraniteConfig",
            variants="embedding, residual, attention and logit multipliers",
            settings=dict(
                embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0
            ),
        ),
        Family(
            "gpt_oss",
            "GptOssConfig",
            moe=True,
            variants=f"attention sinks, sliding window {WINDOW}, YaRN RoPE, 4 experts top-2",
            settings=dict(
                head_dim=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=150000.0,
                    factor=4.0,
                    original_max_position_embeddings=128,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                ),
            ),
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3Config",
            moe=True,
            variants="MLA (value heads narrower than query/key heads), 4 routed experts top-2 and a shared one",
            settings=MOE
            | dict(
                num_key_value_heads=2,
                moe_intermediate_size=32,
                n_routed_experts=4,
                n_shared_experts=1,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                kv_lora_rank=32,
                q_lora_rank=48,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=16,  # queries and keys 32 wide, values 16: MLA's unequal head sizes
                topk_method="noaux_tc",  # DeepSeek-V3's own router (its e_score_correction_bias), as its config says
            ),
        ),
        Family(
            "nemotron_h",
            "NemotronHConfig",
            variants="hybrid: Mamba-2, attention and MLP layers",
            settings=dict(
                num_hidden_layers=3,
                layers_block_type=["mamba", "attention", "mlp"],
                head_dim=32,
                mamba_num_heads=4,
                mamba_head_dim=16,
                ssm_state_size=16,
                n_groups=1,
                chunk_size=16,
            ),
        ),
    ]
}


def build(name: str, path: Path, seed: int = 0, edit: Callable[[transformers.PretrainedConfig], None] | None = None):
    """Save family `name`'s tiny random model in `path` with the demo's tokenizer and chat template; `edit` may
    change the config first. Returns `path`."""
    config = FAMILIES[name].config()
    if edit is not None:
        edit(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / file, Path(path) / file)
    return Path(path)
