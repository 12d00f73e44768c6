"""Where an RL run's parts would run, checked from its config alone: `reinforge grpo --validate` (also ppo, distill).

The same rules as the run's own checks and as the planner's (training/parallel/layout.py `check_layout`,
training/parallel/engine_layout.py `check_engine_layout`): the training ranks' layout against the model's heads,
key/value heads and MLP width, and the engines' count, tensor-parallel size and placement. The model's sizes come
from its config.json (a directory, or a Hub id in the local cache) or, for a model the planner knows by name
(`reinforge plan`'s KNOWN_MODELS, e.g. Qwen/Qwen2.5-32B), from its built-in shape: no weights are loaded, the hub
is not contacted and Ray is not started.
"""

from __future__ import annotations

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.errors import ConfigError
from reinforge.training.parallel.engine_layout import EngineLayout, check_engine_layout
from reinforge.training.parallel.layout import ParallelConfig, check_layout
from reinforge.training.parallel.model_shape import ModelShape, model_shape


def text_config_of(shape: ModelShape):
    """A transformers config of `shape`'s sizes (Qwen2's with q/k/v biases, Llama's without; Qwen3-MoE's for a
    mixture of experts), for the layout checks of a model known only by name."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    sizes = dict(
        hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
    )  # fmt: skip
    if shape.moe:
        return Qwen3MoeConfig(
            **sizes, num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size, head_dim=shape.head_size,
        )  # fmt: skip
    return Qwen2Config(**sizes) if shape.attention_bias else LlamaConfig(**sizes)


def model_text_config(model_config, vision: list[bool] | None = None):
    """The model's text config: from its config.json where there is one, else from its built-in shape. `vision`,
    when given, gets whether the model is a vision-language one (a vision tower beside that text model)."""
    from reinforge.errors import ReinforgeError
    from reinforge.modeling import is_vision_language, model_location

    try:
        from transformers import AutoConfig

        location = model_location(model_config)
        config = AutoConfig.from_pretrained(
            location, trust_remote_code=model_config.trust_remote_code, local_files_only=True
        )
        if vision is not None:
            vision.append(is_vision_language(config))
        return config.get_text_config()
    except (OSError, ValueError, ReinforgeError):  # not on disk nor in the cache: a model known by name
        return text_config_of(model_shape(model_config.name_or_path))


def check_cpu_offload(training, num_gpus_per_worker: float) -> None:
    """`training.cpu_offload` offloads GPU memory: ranks without a GPU refuse it, once started (fsdp2.py); here it is
    one line from the config, before anything starts."""
    on_gpu = num_gpus_per_worker > 0 and training.device != "cpu"
    if training.backend == "fsdp2" and training.cpu_offload and not on_gpu:
        raise ConfigError(
            "training.cpu_offload=true offloads GPU memory to the CPU, and the ranks have no GPU "
            "(cluster.num_gpus_per_worker=0 or training.device=cpu); set it to false"
        )


def check_run_layout(config: RLRunConfig, text_config, vision: bool = False) -> list[str]:
    """The training ranks' and the engines' layout of `config` for a model of `text_config` (`vision`: of a
    vision-language model), checked by the run's rules; a line each saying what runs where. A layout the run refuses
    is its one-line ConfigError."""
    training, cluster, gen = config.training, config.cluster, config.generation
    lines = []
    check_cpu_offload(training, cluster.num_gpus_per_worker)
    if training.backend == "fsdp2":
        if training.parallel == "auto":
            lines.append(f"training: {training.num_workers} FSDP2 ranks, layout planned at start (parallel=auto)")
        else:
            parallel: ParallelConfig = training.parallel.resolved(training.num_workers)
            lora = config.model.lora is not None
            check_layout(parallel, text_config, lora=lora, vision=vision)
            lines.append(
                f"training: {training.num_workers} FSDP2 ranks, dp_replicate={parallel.dp_replicate} "
                f"dp_shard={parallel.dp_shard} tp={parallel.tp} cp={parallel.cp} ep={parallel.ep}"
            )
    else:
        lines.append("training: one process (training.backend=torch)")
    if gen.backend == "vllm":
        colocated = cluster.colocate and training.backend == "fsdp2"
        engines = EngineLayout(gen.num_workers, gen.vllm.tensor_parallel_size, colocated)
        heads = dict(heads=text_config.num_attention_heads, kv_heads=getattr(text_config, "num_key_value_heads", None))
        on_gpu = cluster.num_gpus_per_worker > 0
        check_engine_layout(engines, training.num_workers, cluster.gpus_per_node, on_gpu, **heads)
        where = "on the training ranks' resources" if colocated else "each on resources of its own"
        lines.append(f"generation: {engines.num_engines} vLLM engine(s) of tensor_parallel_size {engines.tp}, {where}")
    return lines


def validate_run(config: RLRunConfig) -> list[str]:
    """`--validate`: the layout checks from the config, with the model's sizes; the lines to print."""
    vision: list[bool] = []
    try:
        text_config = model_text_config(config.model, vision)
    except ConfigError as error:
        raise ConfigError(f"model.name_or_path={config.model.name_or_path}: {error}") from None
    return check_run_layout(config, text_config, any(vision)) + ["valid: no weights loaded, Ray not started"]
