"""A generation backend in another process: any backend class, run as a Ray actor, behind the same
interface. Weights for refit travel through Ray's object store as (name, tensor) pairs."""

from __future__ import annotations

from typing import Any, Iterable

import ray
import torch

from reinforge.cluster.worker_group import raised_in_worker
from reinforge.generation.base import GenerationResult, SamplingParams


class RemoteGenerationBackend:
    """Proxy for a backend living in a Ray actor; `generate`/`update_weights` block until done."""

    def __init__(self, backend_cls: type, *args: Any, num_cpus: float = 1, num_gpus: float = 0, **kwargs: Any):
        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(backend_cls)
        self.actor = actor_cls.remote(*args, **kwargs)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> GenerationResult:
        return _get(self.actor.generate.remote(prompt_token_ids, params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = ray.put([(name, tensor.detach().cpu()) for name, tensor in named_tensors])
        _get(self.actor.update_weights.remote(weights))

    def sleep(self) -> None:
        _get(self.actor.sleep.remote())

    def shutdown(self) -> None:
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        finally:
            ray.kill(self.actor)


def _get(ref: ray.ObjectRef) -> Any:
    """ray.get, with a user-facing error the actor raised (in `__init__` too) re-raised as itself."""
    try:
        return ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        if (error := raised_in_worker(exc)) is not None:
            raise error from None
        raise
