"""M generation engines as Ray actors, data-parallel over prompts, behind the generation interface.

Each engine gets a contiguous slice of the prompts (engine 0 with the step's seed, so one engine
samples exactly what an in-process engine would; the others with seed streams of their own) and the results are
merged in prompt order. A refit puts the weights in the object store once and every engine loads them;
a LoRA adapter sync hands every engine the adapter's path instead (in the run directory: on several nodes
it must be on a shared filesystem).
With `cluster.colocate=true` engine i shares training rank i's placement bundle (they take turns on
the same resources); otherwise the engines get bundles of their own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch

from reinforge.cluster.worker_group import WorkerGroup
from reinforge.generation.base import GenerationResult, SamplingParams
from reinforge.generation.weight_digest import WeightDigests


class GenerationGroup:
    """`num_engines` instances of `worker_cls(**worker_kwargs)` (an engine: VLLMGenerationBackend or
    HFGenerationWorker) as one generation backend."""

    def __init__(
        self,
        worker_cls: type,
        worker_kwargs: dict,
        num_engines: int,
        num_cpus_per_engine: float,
        num_gpus_per_engine: float,
        timeout_s: float,
        share_with: WorkerGroup | None,
    ):
        self.group = WorkerGroup(
            "generation",
            worker_cls,
            num_engines,
            lambda rank, _: worker_kwargs,
            num_cpus_per_worker=num_cpus_per_engine,
            num_gpus_per_worker=num_gpus_per_engine,
            timeout_s=timeout_s,
            share_with=share_with,
        )

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> GenerationResult:
        num_engines = len(self.group.workers)
        size = -(-len(prompt_token_ids) // num_engines)
        starts = range(0, len(prompt_token_ids), size)
        calls = [
            (prompt_token_ids[s : s + size], replace(params, seed=params.seed + 7_919 * i))
            for i, s in enumerate(starts)
        ]
        results = self.group.call_each("generate", calls)  # engines beyond the last slice stay idle
        merged = GenerationResult()
        for start, result in zip(starts, results):
            for group in result.completions:
                for completion in group:
                    completion.prompt_index += start
                merged.completions.append(group)
        return merged

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.group.call("update_weights", [(name, tensor.detach().cpu()) for name, tensor in named_tensors])

    def load_adapter(self, path: str) -> None:
        self.group.call("load_adapter", path)

    def weight_digests(self) -> list[WeightDigests]:
        """Every engine's `weight_digests`, each named as its worker (`generation[i]`)."""
        return self._named(self.group.call("weight_digests"))

    def adapter_digests(self) -> list[WeightDigests]:
        """Every engine's `adapter_digests`, each named as its worker."""
        return self._named(self.group.call("adapter_digests"))

    def _named(self, per_engine: list[list[WeightDigests]]) -> list[WeightDigests]:
        return [
            replace(report, engine=name) for name, reports in zip(self.group.names, per_engine) for report in reports
        ]

    def sleep(self) -> None:
        self.group.call("sleep")

    def shutdown(self) -> None:
        self.group.shutdown()
