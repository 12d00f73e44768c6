"""Loading models and tokenizers through the ordinary Hugging Face path, with one-line errors."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from reinforge.errors import ReinforgeError
from reinforge.model_config import LINEAR_TARGETS, ModelConfig
from reinforge.paths import resolve_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `training.device`, `generation.device`: auto (CUDA when this process sees a GPU, else the CPU), cpu, cuda, cuda:N
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


def resolve_device(setting: str, key: str) -> torch.device:
    """The device a `*.device` setting names in this process: `auto` is the first visible CUDA device where there
    is one, else the CPU; a CUDA device that is not visible is a one-line error naming the setting."""
    if setting == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= visible:
            raise ReinforgeError(
                f"{key}={setting}, but this process sees {visible} CUDA device(s) (torch.cuda.is_available() is "
                f"{torch.cuda.is_available()}); set {key}=auto (CUDA where present, else the CPU) or cpu"
            )
        return torch.device("cuda", index)
    return device


def describe_device(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H200, 139.8 GiB)` or `cpu`: how the run's log names a device."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def model_location(config: ModelConfig) -> str:
    """A local directory (checked to exist) or a hub id like `Qwen/Qwen2.5-1.5B`."""
    path = resolve_path(config.name_or_path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ReinforgeError(
                f"model.name_or_path={config.name_or_path}: {path} has no config.json; "
                "point it at a Hugging Face model directory"
            )
        return str(path)
    looks_like_hub_id = config.name_or_path.count("/") == 1 and not config.name_or_path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: no such directory; "
            "point it at a Hugging Face model directory or a hub id such as Qwen/Qwen2.5-1.5B"
        )
    return config.name_or_path


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    location = model_location(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=config.trust_remote_code)
    except OSError as exc:
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: could not load its tokenizer ({_first_line(exc)})"
        ) from None
    if len(tokenizer) < 2:  # transformers builds an empty tokenizer for a directory without tokenizer files
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: {location} has no tokenizer (tokenizer.json, or vocab and "
            "merges files); copy the tokenizer files of its base model there"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad id; it is always masked out
    return tokenizer


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether a transformers config describes a vision-language model (a vision tower beside its text model)."""
    return getattr(config, "vision_config", None) is not None


def load_processor(config: ModelConfig):
    """A vision-language model's processor (its image processor and tokenizer, processor_config.json); None for a
    text-only model."""
    location = model_location(config)
    if not is_vision_language(AutoConfig.from_pretrained(location, trust_remote_code=config.trust_remote_code)):
        return None
    try:
        return AutoProcessor.from_pretrained(location, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: could not load its processor ({_first_line(exc)}); a "
            "vision-language model needs its processor_config.json (or preprocessor_config.json) beside it"
        ) from None


def save_tokenizer(config: ModelConfig, path: Path) -> None:
    """Write beside exported weights what turns text (and images) into inputs: a vision-language model's processor
    (its image processor, tokenizer and chat template, so transformers' and vLLM's loaders take the directory as is)
    or the tokenizer."""
    (load_processor(config) or load_tokenizer(config)).save_pretrained(path)


VISION_TOWERS = ("vision_model", "visual", "vision_tower")  # the vision encoder's module name, by family
PROJECTORS = ("connector", "multi_modal_projector")  # Idefics3's and LLaVA's; Qwen-VL's `merger` is inside `visual`


def vision_module_pattern() -> str:
    """A regular expression (PEFT's `exclude_modules`) matching every module of the vision tower and projector."""
    return r".*\b(" + "|".join(VISION_TOWERS + PROJECTORS) + r")\b.*"


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop training a vision-language model's vision encoder (Idefics3's `vision_model`, Qwen-VL's `visual` without
    its `merger`, LLaVA's `vision_tower`); the parameters frozen (0 for a text-only model)."""
    frozen = 0
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        if any(tower in parts for tower in VISION_TOWERS) and "merger" not in parts:
            parameter.requires_grad_(False)
            frozen += 1
    return frozen


@dataclass(frozen=True)
class ModelLimits:
    """What a model's config.json says it can take (None where it does not say)."""

    max_positions: int | None  # max_position_embeddings: the longest sequence, prompt and completion together
    vocab_size: int | None  # rows of the embedding: a token id must be below it
    num_experts: int = 0  # routed experts per MoE layer (num_experts, num_local_experts, n_routed_experts); 0: dense


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's names for it
# Routers whose forward is a softmax top-k (transformers 5.19), by class name: from hidden states [N, H] they return
# (logits [N, E], scores [N, K]: the top-k probabilities, renormalised over the k when the model says so,
# indices [N, K]). The generation engine records their indices and the trainer replays them (docs/moe.md).
SOFTMAX_TOPK_ROUTERS = frozenset(
    {
        "Qwen3MoeTopKRouter",
        "Qwen2MoeTopKRouter",
        "OlmoeTopKRouter",
        "FlexOlmoTopKRouter",
        "Qwen3NextTopKRouter",
        "MellumTopKRouter",
        "Qwen3VLMoeTextTopKRouter",
        "MixtralTopKRouter",
        "MiniMaxTopKRouter",
    }
)


def num_experts(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer of a transformers config (0: a dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    blocks = getattr(text, "layers_block_type", None)  # a hybrid's kinds of block (Nemotron-H): maybe no MoE block
    if blocks is not None and "moe" not in blocks:
        return 0
    return int(next((getattr(text, name) for name in EXPERT_COUNTS if getattr(text, name, None)), 0))


def is_moe(config: PretrainedConfig) -> bool:
    """Whether a transformers config describes a mixture-of-experts model."""
    return num_experts(config) > 0


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's softmax top-k routers (`SOFTMAX_TOPK_ROUTERS`), in layer order (empty for a dense model, or one
    whose router is of another kind)."""
    return [m for m in model.modules() if any(c.__name__ in SOFTMAX_TOPK_ROUTERS for c in type(m).__mro__)]


def model_limits(config: ModelConfig) -> ModelLimits:
    """The model's context length, vocabulary size and experts, from its config alone (no weights are loaded)."""
    location = model_location(config)
    try:
        model_config = AutoConfig.from_pretrained(location, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: could not read its config.json ({_first_line(exc)})"
        ) from None
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    positions, vocab = (getattr(text_config, name, None) for name in ("max_position_embeddings", "vocab_size"))
    return ModelLimits(int(positions) if positions else None, int(vocab) if vocab else None, num_experts(model_config))


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def shortest_window(config: ModelConfig) -> int | None:
    """The sliding window of the model's windowed attention layers (Mistral's every layer, those `layer_types` names
    `sliding_attention`: Gemma 2 and 3, gpt-oss, Qwen2 past max_window_layers), None where no layer has one."""
    text = AutoConfig.from_pretrained(model_location(config), trust_remote_code=config.trust_remote_code)
    text = text.get_text_config()
    window, layer_types = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def check_weights(config: ModelConfig) -> None:
    """A local model directory must hold weights (a hub id is left to the download): checked before a run makes
    its directory, so that one without them is one line, not a half-made run."""
    path = resolve_path(config.name_or_path)
    if path.is_dir() and not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: {path} holds no weights (model.safetensors or "
            "pytorch_model.bin); point it at a complete Hugging Face model directory"
        )


def check_fits_context(config: ModelConfig, num_tokens: int, setting: str) -> None:
    """Refuse a run whose sequences (`setting`, e.g. `data.max_seq_len=4096`, of `num_tokens` tokens) can be longer
    than the model's context: past it a rotary model computes positions it was never trained on, and says nothing."""
    limit = model_limits(config).max_positions
    if limit is not None and num_tokens > limit:
        raise ReinforgeError(
            f"{setting} exceeds the model's max_position_embeddings={limit} ({config.name_or_path}); lower it to "
            f"{limit} or less"
        )
    check_rope_scaling(config, num_tokens, setting)


def check_rope_scaling(config: ModelConfig, num_tokens: int, setting: str) -> None:
    """RoPE scalings that transformers computes from the batch instead of each token's position: exact per sequence
    only up to a length. `longrope` (Phi-3 long-context) takes its long factors for the whole batch once its longest
    sequence passes original_max_position_embeddings, and midway through a generation: past that length the
    trainer's packed rows and the engine would each rotate by other factors, so it is a one-line error. `dynamic`
    (NTK) rescales only past max_position_embeddings, which `check_fits_context` refuses: below, it is plain RoPE.
    Position-based scalings (linear, llama3, yarn) are exact in every layout."""
    text = AutoConfig.from_pretrained(model_location(config), trust_remote_code=config.trust_remote_code)
    text = text.get_text_config()
    parameters = getattr(text, "rope_parameters", None) or {}
    for rope in [parameters] if "rope_type" in parameters else parameters.values():
        original = (
            isinstance(rope, dict)
            and rope.get("rope_type") == "longrope"
            and (
                rope.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
            )
        )
        if original and num_tokens > original:
            raise ReinforgeError(
                f"{setting}: sequences past the model's longrope original_max_position_embeddings={original}, "
                "where transformers switches a whole batch to the long factors (the trainer's and the engine's "
                f"logprobs would differ); keep sequences to {original} tokens"
            )


def model_class(hf_config: PretrainedConfig) -> type:
    """The transformers auto class of a policy: image-text-to-text for a vision-language model, else causal LM."""
    return AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM


# Which modules LoRA adapts: training/lora.py's adapters, and vLLM's LoRA layers (the engine's, which must not
# reach into training/).

# Leaf names that PEFT 0.21 maps onto a transformers-5 MoE block's fused expert parameters or its router
# (peft/utils/transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING): never targeted in an MoE model.
MOE_PROJECTIONS = frozenset({"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


def skeleton(model_config: ModelConfig) -> torch.nn.Module:
    """The model built from its config on the meta device (no weights)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_location(model_config), trust_remote_code=model_config.trust_remote_code)
    with torch.device("meta"):
        return model_class(config).from_config(config, trust_remote_code=model_config.trust_remote_code)


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every linear layer but the LM head."""
    head = model.get_output_embeddings()
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }


# Leaf names of a Mamba mixer that PEFT refuses to adapt (its `_check_lora_target_modules_mamba`: the output
# projection and the convolution, which the fused selective-scan kernels read as plain weights).
MAMBA_PROJECTIONS = frozenset({"out_proj", "conv1d"})


def has_mamba(model: torch.nn.Module) -> bool:
    """Whether the model has Mamba (state-space) mixers, e.g. Nemotron-H, Falcon-H1, Mamba 2."""
    return any("Mamba" in type(module).__name__ for module in model.modules())


def adapted_modules(model: torch.nn.Module, target_modules: list[str] | str) -> list[str] | str:
    """What PEFT is asked to adapt: `target_modules` as given, but `all-linear` of an MoE model resolved to its
    linear layers' names without the experts' and the router's (training/lora.py's docstring), e.g. Qwen3-MoE's
    q/k/v/o_proj, and of a model with Mamba mixers without their output projection (`MAMBA_PROJECTIONS`)."""
    if target_modules != LINEAR_TARGETS:
        return target_modules
    excluded = (MOE_PROJECTIONS if is_moe(model.config) else set()) | (MAMBA_PROJECTIONS if has_mamba(model) else set())
    return sorted(linear_names(model) - excluded) if excluded else target_modules


def moe_lora_targets(model_config: ModelConfig) -> list[str] | None:
    """The modules an MoE model's adapter has, for vLLM's `lora_target_modules`; None for a dense model."""
    model = skeleton(model_config)
    return list(adapted_modules(model, model_config.lora.target_modules)) if is_moe(model.config) else None


def load_model(config: ModelConfig, **kwargs) -> PreTrainedModel:
    """The model of `config` (with `model.adapter` merged in); `kwargs` go to `from_pretrained` (a quantization
    config)."""
    location = model_location(config)
    try:
        hf_config = AutoConfig.from_pretrained(location, trust_remote_code=config.trust_remote_code)
        model = model_class(hf_config).from_pretrained(
            location,
            dtype=DTYPES[config.dtype],
            trust_remote_code=config.trust_remote_code,
            **exact_attention_setting(hf_config),
            **kwargs,
        )
    except OSError as exc:
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: could not load the model ({_first_line(exc)})"
        ) from None
    if config.adapter:  # a LoRA run's adapter, merged once into the weights it was trained on
        from peft import PeftModel

        # PEFT loads an adapter for inference, freezing the base; the merged model trains like any other
        model = PeftModel.from_pretrained(model, adapter_base(config)).merge_and_unload().requires_grad_(True)
    return model


def exact_attention_setting(hf_config: PretrainedConfig) -> dict:
    """`attn_implementation="eager"` for a model whose attention sdpa would compute otherwise than the model defines
    it: transformers 5.19's sdpa drops Gemma 2's attention-logit soft-cap (`attn_logit_softcapping`) without a word
    (gpt-oss' sinks load eager by themselves). The HF engine and the trainer's padded layout then run the exact
    attention; the packed layouts take theirs from training/segment_attention.py. Empty for every other model."""
    if getattr(hf_config.get_text_config(), "attn_logit_softcapping", None) is None:
        return {}
    say_once(f"{hf_config.model_type} soft-caps its attention logits, which sdpa cannot do: it runs eager attention")
    return {"attn_implementation": "eager"}


_SAID: set[str] = set()


def say_once(message: str) -> None:
    """Log `message` once per process, as a warning of the `reinforge` logger (a run's logs/dependencies.log)."""
    if message not in _SAID:
        _SAID.add(message)
        logging.getLogger("reinforge").warning(message)


def adapter_base(model_config: ModelConfig) -> str:
    """The adapter directory of `model.adapter`, checked to be a PEFT adapter trained on `model.name_or_path`."""
    path = resolve_path(model_config.adapter)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ReinforgeError(
            f"model.adapter={model_config.adapter}: {config_file} does not exist; point it at a PEFT adapter "
            "directory (a LoRA run's final/)"
        )
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    expected = model_location(model_config)
    if base and not _same_model(base, expected):
        raise ReinforgeError(
            f"model.adapter={model_config.adapter} was trained on {base}, not on model.name_or_path="
            f"{model_config.name_or_path}; load it onto its own base model"
        )
    return str(path)


def _same_model(a: str, b: str) -> bool:
    left, right = resolve_path(a), resolve_path(b)
    if left.exists() and right.exists():
        return left.resolve() == right.resolve()
    return a.rstrip("/") == b.rstrip("/")


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in the backward pass (transformers' per-layer checkpointing).

    Non-reentrant `torch.utils.checkpoint`: it composes with FSDP2's per-layer hooks (the layer is
    unsharded again for the recompute) and with inputs that do not require grad. The recompute runs
    with the attention implementation its forward ran with (`context_fn`): a forward pass picks it by
    its layout (training/segment_attention.py) and the backward pass comes after that choice is undone."""
    config = model.config.get_text_config()

    def same_attention_in_recompute() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), attention_implementation(config, config._attn_implementation)

    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": same_attention_in_recompute}
    )


@contextlib.contextmanager
def attention_implementation(config: PretrainedConfig, name: str) -> Iterator[None]:
    """The attention implementation of `config`'s text model set to `name` inside the block, as it was after (a
    vision-language model's vision tower keeps its own)."""
    config = config.get_text_config()
    saved, config._attn_implementation = config._attn_implementation, name
    try:
        yield
    finally:
        config._attn_implementation = saved


def compile_decoder_layers(model: PreTrainedModel) -> None:
    """`torch.compile` each decoder layer in place (`nn.Module.compile`: module names and state-dict keys
    stay as they are). Inductor fuses the norms, activation, rotary embedding and residual adds between
    the matmuls; the layers share one compiled graph, recompiled once when the shapes vary. Call it
    before FSDP2's `fully_shard`: its unshard/reshard hooks then run outside the compiled code."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ReinforgeError(
            f"training.compile=true compiles the decoder's `layers`, which {model.config.model_type} does not have; "
            "set it to false"
        )
    for layer in layers:
        layer.compile()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
