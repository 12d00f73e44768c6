"""`model.lora`: LoRA's settings (training/lora.py has the code), apart so that the config schema
imports nothing but them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from reinforge.config.section import Section

LINEAR_TARGETS = "all-linear"


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
