"""A generation backend in another process: any backend class, run as a Ray actor, behind the same
interface. Weights for refit travel through Ray's object store as (name, tensor) pairs."""

from __future__ import annotations

from typing import Any, Iterable

import ray
import torch

from reinforge.generation.base import GenerationResult, SamplingParams


class RemoteGenerationBackend:
    """Proxy for a backend living in a Ray actor; `generate`/`update_weights` block until done."""

    def __init__(self, backend_cls: type, *args: Any, num_cpus: float = 1, num_gpus: float = 0, **kwargs: Any):
        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(backend_cls)
        self.actor = actor_cls.remote(*args, **kwargs)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> GenerationResult:
        return ray.get(self.actor.generate.remote(prompt_token_ids, params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = ray.put([(name, tensor.detach().cpu()) for name, tensor in named_tensors])
        ray.get(self.actor.update_weights.remote(weights))

    def sleep(self) -> None:
        ray.get(self.actor.sleep.remote())

    def shutdown(self) -> None:
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        finally:
            ray.kill(self.actor)
