"""`model:`, the model a run loads, and `model.lora`, its LoRA adapters' settings (training/lora.py has their
code), with what a run's other parts read of them (which LoRA ranks vLLM takes, whether the engine takes the
adapter itself). Low in the package so that modeling.py, the engines and the trainers all import it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from reinforge.config.section import Section

LINEAR_TARGETS = "all-linear"
# the ranks vLLM's engine accepts as max_lora_rank (vllm/config/lora.py, MaxLoRARanks); an adapter of a smaller
# rank is padded to it
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Section):
    rank: int = Field(default=16, gt=0)
    """r: the rank of each adapter (B is [out, r], A is [r, in])."""
    alpha: float = Field(default=32.0, gt=0)
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input (0: none; RL usually wants none)."""
    target_modules: list[str] | Literal["all-linear"] = LINEAR_TARGETS
    """Module names to adapt (e.g. [q_proj, v_proj]), or `all-linear`: every linear layer but the LM head."""
    sync: Literal["auto", "adapter", "merged"] = "auto"
    """How the generation engine gets the trained policy: `adapter` (vLLM's LoRA: the engine's base weights are
    never rewritten, each refit loads the new adapter), `merged` (the merged weights refitted in place, as a
    full model's), `auto`: adapter with vLLM, merged with the HF engine."""
    quantize_base: Literal["none", "nf4"] = "none"
    """QLoRA: `nf4` loads the frozen base in 4 bits (bitsandbytes, CUDA GPUs only)."""
    vision: bool = False
    """A vision-language model: also adapt the vision tower and projector (`target_modules` there too); false: the
    language model only, as most peers do (the vision side frozen). Engines: the HF engine, or vLLM with
    `sync=merged` (vLLM's LoRA adapts the language model only)."""


def adapter_sync(lora: LoraConfig | None, engine: str) -> bool:
    """Whether the generation engine (`generation.backend`) takes the adapter itself (vLLM's LoRA) rather than the
    merged weights: `model.lora.sync` with `auto` resolved (adapter with vLLM, merged with the HF engine)."""
    return lora is not None and (lora.sync == "adapter" or (lora.sync == "auto" and engine == "vllm"))


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds an adapter of `rank`."""
    return next(size for size in VLLM_LORA_RANKS if size >= rank)


class MoeConfig(Section):
    """Mixture-of-experts settings (docs/moe.md); read only when the model has experts."""

    router_replay: Literal["off", "rollout"] = "off"
    """`rollout`: the trainer's forward routes every token of a trajectory to the experts the generation engine
    chose when it sampled it, in every MoE layer (router replay: no train/inference routing mismatch); `off`: the
    trainer's router chooses."""
    aux_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of the auxiliary load-balancing loss (Switch Transformer's, as transformers computes it) added to
    the training loss; 0 (the default in RL, as in NeMo-RL and veRL): logged, not trained on."""

    @field_validator("router_replay", mode="before")
    @classmethod
    def _off_is_not_false(cls, value):
        return "off" if value is False else value  # YAML reads a bare `off` (router_replay=off) as false


class ModelConfig(Section):
    name_or_path: str = "models/demo"
    """Hugging Face model id (e.g. Qwen/Qwen2.5-1.5B) or a local directory in Hugging Face format."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training and generation. float32 on CPU; bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Allow model code from the model's repository (only for architectures transformers lacks)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (training/lora.py); null: full fine-tuning."""
    moe: MoeConfig = MoeConfig()
    """Mixture-of-experts settings: router replay and the load-balancing loss (docs/moe.md)."""
    freeze_vision: bool = True
    """A vision-language model: keep its vision tower's weights as they are (most peers do; the projector and the
    language model train); false trains the tower too (docs/vlm.md). No effect on a text-only model."""
    adapter: str | None = None
    """A trained PEFT adapter directory (a LoRA run's final/) merged into the weights of `name_or_path` when
    they load: to evaluate or serve a LoRA run, or to continue from a LoRA stage; it must have been trained
    on `name_or_path`."""
