"""M generation engines as Ray actors, data-parallel over prompts, behind the generation interface.

Each engine gets a contiguous slice of the prompts (engine 0 with the step's seed, so one engine
samples exactly what an in-process engine would; the others with seed streams of their own) and the results are
merged in prompt order. A refit sends the weights from the training ranks to every engine (`wire`,
cluster/weight_sync.py); a LoRA adapter sync hands every engine the adapter's path instead (in the run directory:
on several nodes it must be on a shared filesystem).
`InFlightGroup` is the same for in-flight generation (`rollout.mode=in_flight`): engines that keep generating
while their weights are updated, each call of the rollout workers sent whole to one engine.
An engine of `tensor_parallel_size` N is one actor whose N vLLM workers are its own child processes (vLLM's
multiprocessing executor; on CPU each bound to its share of the cores, `VLLM_CPU_OMP_THREADS_BIND`). With
`cluster.colocate=true` engine i sits in training rank i x N's placement bundle with its workers on the GPUs of
ranks i x N .. i x N + N - 1 (they take turns on the same resources; those ranks must share a node); otherwise
each engine gets a bundle of its own holding N workers' resources and `cluster.generation_resources`
(disaggregated). The rules of both: training/parallel/engine_layout.py.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Iterable

import torch

from reinforge.cluster.config import HEARTBEAT_TIMEOUT_S
from reinforge.cluster.weight_sync import WeightWire
from reinforge.cluster.worker_group import WorkerGroup
from reinforge.errors import ConfigError
from reinforge.generation.base import GenerationResult, SamplingParams
from reinforge.generation.weight_digest import WeightDigests, tp_worker


class GenerationGroup:
    """`num_engines` instances of `worker_cls(**worker_kwargs)` (an engine: VLLMGenerationBackend or
    HFGenerationWorker) as one generation backend."""

    def __init__(
        self,
        worker_cls: type,
        worker_kwargs: dict,
        num_engines: int,
        num_cpus_per_worker: float,
        num_gpus_per_worker: float,
        timeout_s: float,
        share_with: WorkerGroup | None,
        tensor_parallel_size: int = 1,
        resources: dict[str, float] | None = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ):
        """`num_cpus_per_worker`/`num_gpus_per_worker`: one engine worker's (a training rank's) resources; an
        engine holds `tensor_parallel_size` times them, or colocated half of one rank's bundle (the training rank
        takes the other half) with its workers on the GPUs of its ranks."""
        self.group = WorkerGroup(
            "generation", worker_cls, num_engines, lambda rank, _: worker_kwargs, timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            **engine_placement(num_engines, tensor_parallel_size, num_cpus_per_worker, num_gpus_per_worker,
                               share_with, resources),
        )  # fmt: skip
        self.wire = WeightWire(self, timeout_s)  # the refit's, opened at the first (cluster/weight_sync.py)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, images=None) -> GenerationResult:
        """`images`: each prompt's (a vision-language model's image prompts), sent with its slice."""
        num_engines = len(self.group.workers)
        size = -(-len(prompt_token_ids) // num_engines)
        starts = range(0, len(prompt_token_ids), size)
        calls = [
            (prompt_token_ids[s : s + size], replace(params, seed=params.seed + 7_919 * i))
            + (() if images is None else (images[s : s + size],))
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

    def transfer_ranks(self) -> list[int]:
        """Each engine's workers in the refit's transfer group (its tensor-parallel size)."""
        return self.group.call("transfer_ranks")

    def init_weight_transfer(self, infos: list[dict]) -> None:
        """Engine i joins the transfer group with `infos[i]` (its own rank offset); returns once all members have."""
        self.group.call_each("init_weight_transfer", [(info,) for info in infos])

    def receive_weights(self, version: int | None = None) -> None:
        self.group.call("receive_weights", version)

    def refit_layout(self):
        return self.group.call_rank(0, "refit_layout")

    @staticmethod
    def driver_host() -> str:
        """This process's node address (a sender in the driver's process hosts the group here)."""
        import ray

        return ray.util.get_node_ip_address()

    def weight_digests(self, columns: int = 0, step: int = 0) -> list[WeightDigests]:
        """Every engine's `weight_digests` (of the sampled columns), each named as its worker (`generation[i]`)."""
        # whole weights (columns 0): no arguments, which every engine's weight_digests takes
        return self._named(self.group.call("weight_digests", *((columns, step) if columns else ())))

    def weight_layouts(self) -> list[WeightDigests]:
        """Every engine's `weight_layout` (nothing hashed), each named as its worker: the refit check's layouts."""
        return self._named(self.group.call("weight_layout"))

    def adapter_digests(self) -> list[WeightDigests]:
        """Every engine's `adapter_digests`, each named as its worker."""
        return self._named(self.group.call("adapter_digests"))

    def _named(self, per_engine: list[list[WeightDigests]]) -> list[WeightDigests]:
        """Each report named as its engine's worker, and its tensor-parallel worker where the engine has several."""
        return [
            replace(report, engine=name if report.tp_size == 1 else f"{name} {tp_worker(report)}")
            for name, reports in zip(self.group.names, per_engine)
            for report in reports
        ]

    def sleep(self) -> None:
        self.group.call("sleep")

    def shutdown(self) -> None:
        self.group.shutdown()


def engine_placement(
    num_engines: int, tp: int, num_cpus: float, num_gpus: float, share_with: WorkerGroup | None,
    resources: dict[str, float] | None,
) -> dict:  # fmt: skip
    """`WorkerGroup` arguments that place `num_engines` engines of `tp` workers (module docstring): a bundle of
    `tp` workers' resources each, or colocated (`share_with`, the trainer's group) every `tp`-th training rank's
    bundle, half of it, and each engine's CUDA_VISIBLE_DEVICES the GPUs of its `tp` ranks."""
    if share_with is None:
        return dict(num_cpus_per_worker=num_cpus * tp, num_gpus_per_worker=num_gpus * tp, resources=resources)
    placement = dict(
        num_cpus_per_worker=num_cpus * 0.5, num_gpus_per_worker=num_gpus * 0.5, share_with=share_with,
        bundle_stride=tp,
    )  # fmt: skip
    if tp == 1:
        return placement
    nodes = share_with.node_ids()
    for engine in range(num_engines):
        ranks = range(engine * tp, (engine + 1) * tp)
        if len({nodes[rank] for rank in ranks}) > 1:
            raise ConfigError(
                f"cluster.colocate=true: engine {engine}'s {tp} tensor-parallel workers share training ranks "
                f"{ranks.start}..{ranks.stop - 1}, which Ray placed on different nodes; set cluster.colocate=false, "
                "or a tensor_parallel_size that divides the ranks of a node"
            )
    if num_gpus:
        gpus = share_with.gpu_ids()
        devices = [",".join(g for rank in range(e * tp, (e + 1) * tp) for g in gpus[rank]) for e in range(num_engines)]
        placement["env_for_rank"] = lambda engine: {"CUDA_VISIBLE_DEVICES": devices[engine]}
    return placement


class InFlightGroup(GenerationGroup):
    """In-flight engines (`actor_cls(**actor_kwargs)`: generation/vllm_async.py's `AsyncVLLMEngine`, or
    generation/in_flight.py's `InFlightWorker` around an HF engine) as Ray actors that take up to `max_concurrency`
    calls at once: the rollout workers, the endpoint and the refit call from threads of their own. A `generate` call
    goes whole to the engine with the fewest calls running (a group's samples stay on one engine, where they share
    the prompt's cache); new weights go to every engine, over the refit's wire while it generates."""

    def __init__(self, actor_cls: type, actor_kwargs: dict, max_concurrency: int, **group_kwargs):
        self.group = WorkerGroup(
            "generation",
            actor_cls,
            group_kwargs["num_engines"],
            lambda rank, _: actor_kwargs,
            timeout_s=group_kwargs["timeout_s"],
            heartbeat_timeout_s=group_kwargs.get("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S),
            max_concurrency=max_concurrency,
            **engine_placement(
                group_kwargs["num_engines"], group_kwargs.get("tensor_parallel_size", 1),
                group_kwargs["num_cpus_per_worker"], group_kwargs["num_gpus_per_worker"], None,
                group_kwargs.get("resources"),
            ),
        )  # fmt: skip
        self.wire = WeightWire(self, group_kwargs["timeout_s"])  # the refit's, opened at the first
        self._lock = threading.Lock()
        self._calls = [0] * len(self.group.workers)
        self._version = 0

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, images=None) -> GenerationResult:
        with self._lock:
            rank = min(range(len(self._calls)), key=self._calls.__getitem__)
            self._calls[rank] += 1
        try:
            return self.group.call_rank(rank, "generate", prompt_token_ids, params, images)
        finally:
            with self._lock:
                self._calls[rank] -= 1

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        self.group.call("set_version", version)
        self._version = version

    def metrics(self) -> dict[str, float]:
        """The engines' `generation/*` since the last call: idle fraction and sequences per step averaged, updates
        of one engine (each takes every update)."""
        per_engine = self.group.call("metrics")
        return {name: sum(m[name] for m in per_engine) / len(per_engine) for name in per_engine[0]}
