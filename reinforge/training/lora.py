"""LoRA through PEFT, for every recipe and both training backends (`model.lora`).

`add_lora` wraps the policy with PEFT's `get_peft_model` (LoRA adapters injected into the target
linear layers, everything else frozen): the backends keep calling the Hugging Face model itself (PEFT
injects its layers into it), so packing, segment attention, the chunked LM head and FSDP2's per-layer
sharding work unchanged, and only the adapter's parameters get gradients and optimizer state.

- The reference policy (KL, DPO) is the same model with the adapter disabled (`PeftModel.disable_adapter`):
  no second copy in memory.
- Refit: `merge_lora_weights` turns a state dict with PEFT's names (`...q_proj.base_layer.weight`,
  `...q_proj.lora_A.default.weight`, ...) into the Hugging Face state dict of the merged model,
  W + (alpha / r) B A, computed afresh from the unchanged base weights every time (merging into the
  base and unmerging again, PEFT's `merge_adapter`, drifts in bf16). Or the engine takes the adapter
  itself (vLLM's LoRA: `model.lora.sync`), and its base weights are never rewritten.
- Checkpoints hold the adapter and its optimizer state; `final/` holds the adapter in PEFT's format
  (`reinforge convert --merge` writes the merged model).
- Mixture-of-experts models (transformers 5's fused experts): `all-linear` adapts the linear layers outside the
  MoE blocks, i.e. the attention projections (`adapted_modules`), never the routed experts or the router. PEFT
  0.21 would also wrap the fused expert parameters (`target_parameters`) and the router there; vLLM 0.32 serves
  LoRA on experts only through Triton kernels (no CPU) and `merge_lora_weights` merges linear layers only; a
  router left as trained keeps router replay's routes meaningful. vLLM's engine then wraps only those modules
  (modeling.py's `moe_lora_targets`, its `lora_target_modules`), so its CPU fused-MoE kernel stays.
- `model.adapter` loads a trained PEFT adapter onto `model.name_or_path` and merges it into the weights
  (modeling.py; for `reinforge eval` and `serve`, and for a stage that continues from a LoRA stage).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch

from reinforge.errors import ConfigError
from reinforge.model_config import LINEAR_TARGETS, LoraConfig
from reinforge.modeling import (
    MAMBA_PROJECTIONS,
    adapted_modules,
    adapter_base,
    has_mamba,
    is_vision_language,
    linear_names,
    model_location,
    skeleton,
    vision_module_pattern,
)

ADAPTER = "default"  # PEFT's name for the one adapter


def check_lora(model_config) -> None:
    """One-line errors before anything runs: target modules the model does not have, QLoRA without a GPU, an
    adapter (`model.adapter`) trained on another base model. Builds the model's skeleton on the meta device."""
    lora = model_config.lora
    if model_config.adapter:
        adapter_base(model_config)
    if lora is None:
        return
    if lora.quantize_base != "none" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.lora.quantize_base={lora.quantize_base} (QLoRA) needs a CUDA GPU for bitsandbytes' 4-bit "
            "kernels; set it to none on this machine"
        )
    if lora.target_modules == LINEAR_TARGETS:
        return
    model = skeleton(model_config)
    names = linear_names(model)
    refused = sorted(set(lora.target_modules) & MAMBA_PROJECTIONS) if has_mamba(model) else []
    if refused:
        raise ConfigError(
            f"model.lora.target_modules: {refused[0]!r} is a Mamba mixer's, which PEFT does not adapt in "
            f"{model.config.model_type}; remove it (all-linear leaves it out)"
        )
    missing = [name for name in lora.target_modules if name not in names]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules: {missing[0]!r} is not a linear module of {model_config.name_or_path}; "
            f"its linear modules are {', '.join(sorted(names))} (or use all-linear)"
        )


def add_lora(model: torch.nn.Module, lora: LoraConfig, base_name: str, task_type: str = "CAUSAL_LM"):
    """`model` wrapped by PEFT with fresh adapters (B = 0: the policy starts as the base model); returns the
    PeftModel. Only the adapters require grad; with task_type `SEQ_CLS` (a reward model) PEFT also trains and
    saves the classification head, whole (its `modules_to_save`), and never adapts it."""
    import peft

    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        bias="none",
        task_type=task_type,
        target_modules=adapted_modules(model, lora.target_modules),
        # a vision-language model's vision tower and projector keep their weights unless lora.vision
        exclude_modules=None if lora.vision or not is_vision_language(model.config) else vision_module_pattern(),
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # a target the model lacks (check_lora catches it before any run directory is made)
        raise ConfigError(f"model.lora.target_modules: {' '.join(str(exc).split())}") from None
    wrapped.peft_config[ADAPTER].base_model_name_or_path = base_name
    return wrapped


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model a PeftModel wraps (its LoRA layers injected), or `model` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextmanager
def adapter_disabled(peft_model) -> Iterator[None]:
    """The base model's outputs from the same modules: the reference policy of a LoRA run."""
    with peft_model.disable_adapter() if peft_model is not None else nullcontext():
        yield


def scaling(lora: LoraConfig) -> float:
    return lora.alpha / lora.rank


def merge_lora_weights(state_dict: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of the merged model from one with PEFT's names: every adapted
    `X.base_layer.weight` becomes `X.weight` = W + scale * B @ A (in fp32, then W's dtype), its bias
    `X.bias`; the adapters' own entries are dropped; everything else keeps its name and tensor."""
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name:
            continue
        if ".base_layer." not in name:
            merged[name] = tensor
            continue
        module, _, leaf = name.partition(".base_layer.")
        if leaf == "weight" and f"{module}.lora_A.{ADAPTER}.weight" in state_dict:
            a, b = state_dict[f"{module}.lora_A.{ADAPTER}.weight"], state_dict[f"{module}.lora_B.{ADAPTER}.weight"]
            tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)
        merged[f"{module}.{leaf}"] = tensor
    return merged


def is_adapter_key(name: str) -> bool:
    return ".lora_" in name


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights (what a LoRA checkpoint holds), by their names in the Hugging Face model."""
    return {name: tensor for name, tensor in inner_model(model).state_dict().items() if is_adapter_key(name)}


def load_adapter_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = inner_model(model).load_state_dict(state, strict=False)
    missing = [name for name in missing if is_adapter_key(name)]
    if missing or unexpected:
        raise ConfigError(
            f"the checkpoint's adapter does not fit this model's (missing {missing[:2]}, unexpected {unexpected[:2]}); "
            "resume with the same model.lora"
        )


def load_policy(model_config, dtype: str | None = None):
    """The model to train, as (the Hugging Face model the backends call, its PeftModel or None): with
    `model.lora`, fresh adapters on the (optionally 4-bit, QLoRA) frozen base; else the plain model."""
    from reinforge.modeling import load_model

    config = model_config if dtype is None else model_config.model_copy(update={"dtype": dtype})
    lora = config.lora
    if lora is None:
        return load_model(config), None
    quantization = None
    if lora.quantize_base == "nf4":
        from transformers import BitsAndBytesConfig

        from reinforge.modeling import DTYPES

        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=DTYPES[config.dtype],
            bnb_4bit_use_double_quant=True,
        )
    model = load_model(config, quantization_config=quantization)
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_model = add_lora(model, lora, base_name=absolute_location(config))
    return inner_model(peft_model), peft_model


def absolute_location(model_config) -> str:
    """Where the base model is, as the adapter's `base_model_name_or_path`: an absolute path, or the hub id."""
    location = model_location(model_config)
    path = Path(location)
    return str(path.resolve()) if path.exists() else location


def save_merged(model_config, adapter_dir: Path, out: Path) -> Path:
    """A whole Hugging Face model in `out` (written atomically): the base of `model_config` with the PEFT
    adapter in `adapter_dir` merged into it, in the config's dtype, with the tokenizer."""
    from reinforge.modeling import load_model, save_tokenizer
    from reinforge.run_dir import atomic_directory

    config = model_config.model_copy(update={"lora": None, "adapter": str(adapter_dir)})
    model = load_model(config)
    if out.exists():
        import shutil

        shutil.rmtree(out)  # a merge cut short earlier: made again from the adapter
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(config, tmp)
    return out
