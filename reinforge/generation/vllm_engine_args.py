"""The arguments of a vLLM engine, in-process (`VLLMGenerationBackend`'s `LLM`) or in a process of its own
(`AsyncVLLMEngine`'s `AsyncLLM`, generation/vllm_async.py), and the environment vLLM reads when it starts."""

from __future__ import annotations

import os

import torch

from reinforge.generation.checkpoint_layout import skeleton
from reinforge.generation.vllm_moe import check_lora_supported, check_routes_supported
from reinforge.generation.vllm_support import keeps_state
from reinforge.model_config import vllm_max_lora_rank


def cpu_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` tensor-parallel CPU workers: this process's cores in equal
    contiguous shares ("0|1" for two workers on two cores); a one-line error when there are fewer cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        from reinforge.errors import ConfigError

        raise ConfigError(
            f"generation.vllm.tensor_parallel_size={workers} needs a core per worker on CPU, and this process has "
            f"{len(cores)}; lower it to {len(cores)} or less"
        )
    share = len(cores) // workers
    groups = [cores[i * share : (i + 1) * share] for i in range(workers)]
    return "|".join(",".join(map(str, group)) for group in groups)


def check_engine_settings(on_gpu: bool, sleep_mode: bool | None, block_size: int | None) -> bool:
    """One-line errors for settings this machine's vLLM cannot honour; whether the engine sleeps (GPU: by default)."""
    from reinforge.errors import ConfigError

    if sleep_mode and not on_gpu:
        raise ConfigError(
            "generation.vllm.sleep_mode=true needs a GPU (vLLM has no sleep mode on CPU); set it to false or null"
        )
    if block_size is not None and (block_size < 1 or (not on_gpu and block_size % 32)):
        raise ConfigError(
            f"generation.vllm.block_size={block_size}: vLLM's CPU attention needs a multiple of 32; "
            "set 32, 64 or 128, or null"
        )
    return on_gpu if sleep_mode is None else sleep_mode


def lora_engine_kwargs(on_gpu: bool, model_path: str, lora_rank: int, lora_targets: list[str] | None) -> dict:
    """vLLM's LoRA settings for an adapter of `lora_rank`, its layers only where the adapter has weights."""
    check_lora_supported(on_gpu, model_path)
    lora = dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)
    if lora_targets is not None:
        lora["lora_target_modules"] = list(lora_targets)
    return lora


def engine_arguments(
    model_path: str,
    dtype: str,
    seed: int,
    max_model_len: int,
    enforce_eager: bool | None = None,
    block_size: int | None = None,
    cpu_kv_cache_gb: int = 1,
    gpu_memory_utilization: float = 0.5,
    sleep_mode: bool | None = None,
    lora_rank: int | None = None,
    tensor_parallel_size: int = 1,
    lora_targets: list[str] | None = None,
    route_experts: bool = False,
    own_process: bool = False,
) -> dict:
    """vLLM's engine arguments (`LLM(**...)`, `AsyncEngineArgs(**...)`) for `VLLMGenerationBackend`'s settings,
    after setting the environment vLLM reads at start-up; `own_process`: the engine core in a process of its own
    (V1 multiprocessing, what `AsyncLLM` needs), else in this one, where a refit hands it tensors directly."""
    on_gpu = torch.cuda.is_available()
    if route_experts:
        check_routes_supported(on_gpu)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM returns routes from Model Runner V2 only
    sleep_mode = check_engine_settings(on_gpu, sleep_mode, block_size)
    lora = lora_engine_kwargs(on_gpu, model_path, lora_rank, lora_targets) if lora_rank is not None else {}
    # Before importing vllm: it reads these when its engine starts.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gb))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if tensor_parallel_size > 1 and not on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel_size)
    from reinforge.generation.vllm_transfer import transfer_config  # imports vllm

    # before the engine: vLLM's Transformers backend patches transformers' model class in place at start-up
    skeleton(model_path)
    return dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        # on CPU, where chunked prefill is off, not for a model with Mamba layers (vllm_support.py)
        enable_prefix_caching=on_gpu or not keeps_state(model_path),
        logprobs_mode="processed_logprobs",
        # CPU: torch.compile costs ~35 s of start-up and buys little for small models.
        enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        # A partially prefilled request "un-samples" its token by rewinding its seeded generator,
        # which CPU generators cannot do; whole-prompt prefills never need the rewind.
        enable_chunked_prefill=on_gpu,
        enable_sleep_mode=sleep_mode,
        tensor_parallel_size=tensor_parallel_size,
        # its workers are this process's children, in a Ray actor too (vLLM would pick its Ray executor there,
        # which its CPU platform lacks)
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        **({} if block_size is None else {"block_size": block_size}),
        **({"enable_return_routed_experts": True} if route_experts else {}),
        weight_transfer_config=transfer_config(),  # the refit's wire (vllm_transfer.py)
        **lora,
    )


def model_facts(model_config) -> tuple[int | None, int]:
    """From a vLLM engine's `model_config`: the image token of a vision-language model (None for text only), and
    the number of experts of a mixture-of-experts model (0 for a dense one)."""
    hf_config, text_config = model_config.hf_config, model_config.hf_text_config
    image_token = getattr(hf_config, "image_token_id", getattr(hf_config, "image_token_index", None))
    return image_token, getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", 0)
