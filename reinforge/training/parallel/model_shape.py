"""The shape of a decoder model as the layout planner (planner.py) sees it: its sizes from a Hugging Face
config or a built-in table, and its parameter counts, by part: each layer's attention, MLP or mixture of experts,
norms, and the embeddings and LM head.

Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE's routed experts, Mixtral; every layer an MoE layer, no shared
expert): each layer has a router [E, H] and E experts of three [H, I_moe] matrices (`expert_parameters`) instead
of the dense MLP. The total counts every expert; the active parameters (`active_parameters`), what one token
computes with, count top_k / E of the experts and everything else: Qwen3-30B-A3B's 30.5B total, 3.3B active.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reinforge.errors import ConfigError

# families whose layers tensor parallelism cannot split exactly (parallel/tensor_plan.py), with the reason
TP_REFUSED = {
    "nemotron_h": "its Mamba-2 mixer layers (the SSM scan over a sequence-sharded stream) have no tensor-parallel "
    "split here",
}

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a Llama/Qwen2/Qwen3(-MoE)-style decoder (a Hugging Face config's fields)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2's q/k/v projections have biases, Llama's none
    head_dim: int | None = None
    num_experts: int = 0  # routed experts per layer of a mixture of experts; 0: a dense model
    num_experts_per_tok: int = 0  # top_k: the experts each token is sent to
    moe_intermediate_size: int = 0  # I_moe: one expert's MLP width
    qk_norm: bool = False  # Qwen3: an RMSNorm weight on each head's queries and keys (head_dim each)
    tensor_parallel: bool = True  # tensor parallelism can split it (not a family of TP_REFUSED)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer: attention, and the dense MLP's (an MoE layer has
        experts instead: `expert_parameters`)."""
        h, q, kv, i = self.hidden_size, self.num_attention_heads * self.head_size, self.kv_width, self.intermediate_size
        attention = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h))
        return attention if self.moe else attention | dict(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))

    def expert_parameters(self) -> int:
        """One layer's routed experts: E x (gate, up, down) of H x I_moe each (0 for a dense model)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_size

    def layer_parameters(self) -> int:
        """One decoder layer: its linear layers, q/k/v biases where the model has them, two RMSNorm weights (and
        Qwen3's query and key norms); an MoE layer's router [E, H] and experts."""
        q = self.num_attention_heads * self.head_size
        bias = q + 2 * self.kv_width if self.attention_bias else 0
        norms = 2 * self.hidden_size + (2 * self.head_size if self.qk_norm else 0)
        router = self.num_experts * self.hidden_size
        return sum(i * o for i, o in self.linear_shapes().values()) + bias + norms + router + self.expert_parameters()

    def root_parameters(self) -> int:
        """Embeddings, the LM head when untied, the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def parameters(self) -> int:
        return self.num_hidden_layers * self.layer_parameters() + self.root_parameters()

    def active_parameters(self) -> int:
        """The parameters one token computes with: all but the experts, and top_k / E of those."""
        experts = self.num_hidden_layers * self.expert_parameters()
        routed = experts * self.num_experts_per_tok // self.num_experts if self.moe else 0
        return self.parameters() - experts + routed

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """A and B of every targeted linear layer of every decoder layer: rank x (in + out) each."""
        shapes = self.linear_shapes()
        return self.num_hidden_layers * sum(rank * sum(shapes[name]) for name in targets if name in shapes)


def _qwen2(h, layers, heads, kv, i, vocab, tied):
    return ModelShape(h, layers, heads, kv, i, vocab, tied, attention_bias=True)


def _llama(h, layers, heads, kv, i):
    return ModelShape(h, layers, heads, kv, i, 128256, tie_word_embeddings=False, attention_bias=False)


def _qwen3_moe(h, layers, heads, kv, i, experts, top_k, i_moe):
    return ModelShape(
        h, layers, heads, kv, i, 151936, tie_word_embeddings=False, attention_bias=False, head_dim=128,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=i_moe, qk_norm=True,
    )  # fmt: skip


# From each model's config.json on the Hugging Face Hub, for planning offline.
KNOWN_MODELS = {
    "Qwen2.5-0.5B": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "Qwen2.5-1.5B": _qwen2(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen2.5-7B": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "Qwen2.5-32B": _qwen2(5120, 64, 40, 8, 27648, 152064, False),
    "Qwen2.5-72B": _qwen2(8192, 80, 64, 8, 29568, 152064, False),
    "Llama-3-8B": _llama(4096, 32, 32, 8, 14336),
    "Llama-3-70B": _llama(8192, 80, 64, 8, 28672),  # Llama 3.1-70B and 3.3-70B have the same shape
    "Llama-3.1-405B": _llama(16384, 126, 128, 8, 53248),
    "Qwen3-30B-A3B": _qwen3_moe(2048, 48, 32, 4, 6144, 128, 8, 768),
    "Qwen3-235B-A22B": _qwen3_moe(4096, 94, 64, 4, 12288, 128, 8, 1536),
}


def shape_of_config(config: dict) -> ModelShape:
    """The shape from a Hugging Face config (config.json's dict; a multimodal one's text_config)."""
    config = config.get("text_config", config)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0  # Qwen-MoE's, Mixtral's
    return ModelShape(
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
        head_dim=config.get("head_dim"),
        num_experts=experts,
        num_experts_per_tok=config.get("num_experts_per_tok") or 0 if experts else 0,
        moe_intermediate_size=(config.get("moe_intermediate_size") or config["intermediate_size"]) if experts else 0,
        qk_norm=config.get("model_type", "").startswith("qwen3"),
        tensor_parallel=config.get("model_type") not in TP_REFUSED,
    )


def model_shape(name_or_path: str) -> ModelShape:
    """A local model directory (its config.json), a built-in name (`KNOWN_MODELS`, also as a Hub id such as
    Qwen/Qwen2.5-1.5B or meta-llama/Llama-3.3-70B-Instruct), or a Hub id in the local Hugging Face cache."""
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return _shape_of_file(path / "config.json")
    base = name_or_path.rsplit("/", 1)[-1].lower().removeprefix("meta-")
    bases = (base, base.replace("llama-3.1-", "llama-3-").replace("llama-3.3-", "llama-3-"))  # 70B: one shape
    for name, shape in KNOWN_MODELS.items():
        if any(b == name.lower() or b.startswith(name.lower() + "-") for b in bases):
            return shape
    try:
        from transformers import AutoConfig

        return shape_of_config(AutoConfig.from_pretrained(name_or_path, local_files_only=True).to_dict())
    except (OSError, ValueError):  # not in the cache; not a valid Hub id
        raise ConfigError(
            f"no model config for {name_or_path!r}: give a directory with a config.json or one of "
            f"{', '.join(KNOWN_MODELS)}"
        ) from None


SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def _shape_of_file(path: Path) -> ModelShape:
    """`shape_of_config` of a config.json, whose faults (not JSON, a missing or non-positive size) are one line."""
    try:
        config = json.loads(path.read_text())
        shape = shape_of_config(config)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except KeyError as exc:
        raise ConfigError(
            f"{path} has no {exc.args[0]}: the planner needs a decoder's sizes ({', '.join(SIZES)})"
        ) from None
    except (AttributeError, TypeError):
        raise ConfigError(f"{path} is not a model config (a JSON object of a decoder's sizes)") from None
    for name in (*SIZES, "vocab_size"):
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{path}: {name}={value!r} must be a positive integer")
    return shape
