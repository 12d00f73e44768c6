"""`model:`, the model a run loads (config/schema.py's `ModelConfig`), in a module of its own so that
modeling.py can import it without the schema (which imports every environment's config, some of whose
environments load models through modeling.py)."""

from __future__ import annotations

from typing import Literal

from reinforge.config.section import Section
from reinforge.training.lora_config import LoraConfig


class ModelConfig(Section):
    name_or_path: str = "models/demo"
    """Hugging Face model id (e.g. Qwen/Qwen2.5-1.5B) or a local directory in Hugging Face format."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training and generation. float32 on CPU; bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Allow model code from the model's repository (only for architectures transformers lacks)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (training/lora.py); null: full fine-tuning."""
    adapter: str | None = None
    """A trained PEFT adapter directory (a LoRA run's final/) merged into the weights of `name_or_path` when
    they load: to evaluate or serve a LoRA run, or to continue from a LoRA stage; it must have been trained
    on `name_or_path`."""
