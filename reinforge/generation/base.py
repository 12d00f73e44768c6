"""The generation backend interface.

A generation backend turns prompt token ids into sampled completions with the per-token logprobs of
the distribution it sampled from. It exchanges token ids, never text. Implementations: `hf.py`
(Hugging Face transformers, the reference) and `vllm_backend.py` (vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    num_samples: int = 1  # completions per prompt
    seed: int = 0


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index of the prompt in the request
    token_ids: list[int]  # generated tokens, including the stop token when one was produced
    logprobs: list[float]  # logprob of each generated token under the sampling distribution
    finish_reason: Literal["stop", "length"]  # "length": hit max_new_tokens (truncated)


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

    def sleep(self) -> None:
        """Free accelerator memory for the trainer until the next `update_weights` or `generate`
        (which wake the engine); a no-op for engines that cannot."""
        ...

    def shutdown(self) -> None:
        """Release the engine's memory and processes."""
        ...
