"""The layout of the training ranks: `training.parallel`, its device mesh, and `parallel=auto`.

`training.num_workers` ranks form a 5-D device mesh (PyTorch's `DeviceMesh`), outermost first:

- `pp`: pipeline stages, each holding a contiguous run of the decoder's layers (parallel/pipeline.py), outermost
  so that a stage's other dimensions sit on one node and only activations cross nodes;
- `dp_replicate`: copies of the model (HSDP's replicate dimension: gradients all-reduced between copies);
- `dp_shard`: FSDP2's shards within a copy (gradients reduce-scattered);
- `cp`: context parallelism, a sequence split over ranks (Ulysses all-to-all, parallel/context.py);
- `tp`: tensor parallelism with sequence parallelism (parallel/tensor.py), innermost, so that its ranks are
  neighbours (one node's NVLink on GPU).

Ranks that differ only in `pp`, `cp` or `tp` train on the same sequences; the batch is shared over
`dp_replicate x dp_shard` ranks. FSDP2 shards the parameters over `dp_shard x cp` (cp ranks hold the same
weights, so they shard them like data-parallel ranks, as torchtitan does) and replicates over `dp_replicate`.
Expert parallelism (`ep`) borrows its ranks from `dp_shard x cp` (parallel/expert.py).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from reinforge.config.section import Section
from reinforge.errors import ConfigError
from reinforge.modeling import model_location
from reinforge.training.parallel.expert import check_expert_layout
from reinforge.training.parallel.lora_tensor import check_lora_dropout
from reinforge.training.parallel.tensor_plan import check_tensor_parallel

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
PP_SCHEDULES = ("1F1B", "GPipe")


class ParallelConfig(Section):
    """`training.parallel`: how `training.num_workers` ranks split the work (their product is the rank count)."""

    dp_shard: int = Field(default=-1, ge=-1)
    """FSDP2 shards of each model copy; -1: the ranks the other dimensions leave."""
    dp_replicate: int = Field(default=1, ge=1)
    """Model copies (HSDP: FSDP2 within a copy, gradients all-reduced between copies; e.g. one copy per node)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel ranks (with sequence parallelism): heads, MLP columns and the vocabulary split over them.
    It must divide the attention heads, the key/value heads and the MLP's intermediate size."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel ranks: each sequence's positions split over them (Ulysses: heads / tp must divide by cp)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel ranks of a mixture-of-experts model: its experts split over them, tokens sent to their
    experts' rank by all-to-all (training/parallel/expert.py). Borrowed from FSDP2's shard ranks, not added to
    them: it must divide dp_shard x cp and the experts per layer."""
    pp: int = Field(default=1, ge=1)
    """Pipeline stages: the decoder's layers split into `pp` contiguous runs, one per stage (the embedding on the
    first, the final norm and the LM head on the last), micro-batches flowing through them by `pp_schedule`. It
    must not exceed the decoder's layers."""
    pp_schedule: Literal["1F1B", "GPipe"] = "1F1B"
    """The pipeline's schedule (PyTorch's `torch.distributed.pipelining`): `1F1B` holds at most `pp` micro-batches'
    activations per stage; `GPipe` runs every forward before any backward (all of them held). Both idle a
    fraction (pp - 1) / (pp_microbatches + pp - 1) of each pass (the bubble)."""
    pp_microbatches: int | None = Field(default=None, ge=1)
    """Micro-batches each pipeline pass runs (the more, the smaller the bubble); None: the micro-batches
    `training.micro_batch_size` or `micro_batch_tokens` cut a data-parallel rank's share into, at least `pp`."""

    def resolved(self, num_workers: int) -> "ParallelConfig":
        """With `dp_shard` filled in; a one-line error when the dimensions do not multiply to `num_workers`."""
        others = self.pp * self.dp_replicate * self.tp * self.cp
        dp_shard = num_workers // others if self.dp_shard == -1 else self.dp_shard
        if dp_shard < 1 or others * dp_shard != num_workers:
            raise ConfigError(
                f"training.parallel: pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x "
                f"cp={self.cp} x tp={self.tp} must multiply to training.num_workers={num_workers}; "
                f"e.g. training.num_workers={others * max(dp_shard, 1)}, or dp_shard=-1 with a num_workers that "
                f"{others} divides"
            )
        if (dp_shard * self.cp) % self.ep:
            divisors = [e for e in range(1, dp_shard * self.cp + 1) if dp_shard * self.cp % e == 0]
            raise ConfigError(
                f"training.parallel.ep={self.ep} must divide dp_shard x cp = {dp_shard} x {self.cp} (expert "
                f"parallelism borrows FSDP2's shard ranks); the nearest valid ep is "
                f"{min(divisors, key=lambda e: (abs(e - self.ep), e))}"
            )
        return self.model_copy(update={"dp_shard": dp_shard})

    @property
    def data_parallel(self) -> int:
        """Ranks with distinct shares of each batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def sequence_shards(self) -> int:
        """Pieces each row's positions are cut into (rows are padded to a multiple of it)."""
        return self.tp * self.cp

    def is_plain(self) -> bool:
        """Data parallelism only: no tensor, context or pipeline parallelism."""
        return self.tp == 1 and self.cp == 1 and self.pp == 1


ParallelSetting = ParallelConfig | Literal["auto"]


def check_layout(
    parallel: ParallelConfig, text_config, stateful: bool = False, lora: bool = False, vision: bool = False
) -> None:
    """The model can be split this way: a one-line error naming the nearest valid tp, cp or ep otherwise, or what
    the layout cannot split: recurrent layers (`stateful`, transformers' `_is_stateful`) under context parallelism,
    a vision-language model (`vision`) in pipeline stages, pipeline stages with context parallelism. `lora` refuses
    nothing: the adapters are split with their base layers (parallel/lora_tensor.py)."""
    check_expert_layout(parallel, text_config)
    if parallel.cp > 1 and stateful:
        raise ConfigError(
            f"{text_config.model_type} has recurrent (state-space) layers, which context parallelism would cut "
            "mid-sequence; set training.parallel.cp=1"
        )
    if parallel.pp > 1 and parallel.pp > text_config.num_hidden_layers:
        raise ConfigError(
            f"training.parallel.pp={parallel.pp} stages need at least one decoder layer each, and "
            f"{text_config.model_type} has {text_config.num_hidden_layers}; set training.parallel.pp <= "
            f"{text_config.num_hidden_layers}"
        )
    if parallel.pp > 1 and parallel.pp_schedule == "1F1B" and (parallel.pp_microbatches or parallel.pp) < parallel.pp:
        raise ConfigError(
            f"training.parallel.pp_microbatches={parallel.pp_microbatches} is fewer than the pp={parallel.pp} stages, "
            f"which 1F1B needs at least; set pp_microbatches >= {parallel.pp} (or pp_schedule=GPipe)"
        )
    if parallel.pp > 1 and vision:
        raise ConfigError(
            "pipeline parallelism of a vision-language model is not supported (its vision tower feeds the first "
            "stage's embeddings); set training.parallel.pp=1: tp, cp and FSDP2 split it"
        )
    heads = text_config.num_attention_heads
    if parallel.tp > 1:
        check_tensor_parallel(parallel.tp, text_config)
    if parallel.cp > 1:
        local_heads = heads // parallel.tp
        if local_heads % parallel.cp:
            valid = [c for c in range(1, local_heads + 1) if local_heads % c == 0]
            nearest = min(valid, key=lambda c: (abs(c - parallel.cp), c))
            raise ConfigError(
                f"training.parallel.cp={parallel.cp} must divide the attention heads per tensor-parallel rank "
                f"({heads} / tp {parallel.tp} = {local_heads}) for Ulysses' head scatter; "
                f"the nearest valid cp is {nearest}"
            )


def check_model_layout(parallel: ParallelSetting, model_config) -> None:
    """`check_layout` from the model's config alone (no weights), before the run directory: the ranks check again
    on the loaded model. `auto` is planned to fit (planner.py)."""
    if not isinstance(parallel, ParallelConfig) or (parallel.is_plain() and parallel.ep == 1):
        return
    from transformers import AutoConfig

    from reinforge.modeling import is_vision_language, model_class

    config = AutoConfig.from_pretrained(model_location(model_config), trust_remote_code=model_config.trust_remote_code)
    stateful, lora = getattr(model_class(config), "_is_stateful", False), model_config.lora is not None
    check_layout(parallel, config.get_text_config(), stateful, lora, is_vision_language(config))
    if lora:
        check_lora_dropout(parallel.tp, model_config.lora.dropout)


def build_mesh(device_type: str, parallel: ParallelConfig) -> DeviceMesh:
    """The 5-D mesh (MESH_DIMS) with the flattened dimensions the strategy uses: `dp` (the batch's shares),
    `dp_shard_cp` (FSDP2's shard dimension) and `dp_cp` (the ranks whose gradients are summed)."""
    shape = (parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def fsdp_mesh(mesh: DeviceMesh, parallel: ParallelConfig) -> DeviceMesh:
    """FSDP2's mesh: shards over dp_shard x cp, and HSDP's replicate dimension when there are copies."""
    if parallel.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


def _by_mesh(tensors: list[torch.Tensor], key=lambda t: t) -> list[list[torch.Tensor]]:
    """Groups of tensors whose (gradient) DTensors share a mesh and placements; plain tensors form one group."""
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for tensor in tensors:
        value = key(tensor)
        groups.setdefault((value.device_mesh, value.placements) if isinstance(value, DTensor) else None, []).append(
            tensor
        )
    return list(groups.values())


def clip_gradients(
    parameters: list[torch.nn.Parameter], max_norm: float, group=None, uncounted: frozenset[int] = frozenset()
) -> torch.Tensor:
    """Clip by the global L2 norm of gradients that are DTensors on different meshes (FSDP2 x TP's 2-D mesh beside
    FSDP2's 1-D one) or plain tensors, each group of one mesh reducing its own norm; the norm before clipping.
    Pipeline stages: the squares summed over `group` too, the parameters whose id is in `uncounted` (a tied
    embedding's second copy) clipped but not counted."""
    parameters = [p for p in parameters if p.grad is not None]
    squares = [torch.zeros((), device=parameters[0].grad.device)] if parameters else [torch.zeros(())]
    for grads in _by_mesh([p.grad for p in parameters if id(p) not in uncounted]):
        norm = torch.nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum()
    if group is not None:
        dist.all_reduce(total, group=group)
    total = total.sqrt()
    for group in _by_mesh(parameters, key=lambda p: p.grad):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


# --- training.parallel=auto ---------------------------------------------------------------------------


def check_auto_layout(training, num_gpus_per_worker: float) -> None:
    """`parallel=auto` for GPU ranks plans with the driver's GPU memory: a driver without a GPU is one line (the run
    checks it before its run directory exists)."""
    gpus = training.parallel == "auto" and training.backend != "torch" and num_gpus_per_worker > 0
    if gpus and not torch.cuda.is_available():
        raise ConfigError(
            "training.parallel=auto needs the GPUs' memory, and this driver has no GPU; run it on a GPU node or set "
            "training.parallel's dp_shard, tp and cp (`reinforge plan` prints a layout)"
        )


def resolve_auto(
    training, model_config, seq_len: int, kl: bool = False, generation: str = "none", num_gpus_per_worker: float = 0
):
    """`training` with `parallel=auto` replaced by the planner's layout (training/parallel/planner.py) for its
    `num_workers` ranks of this machine's accelerator (the driver's GPU; on CPU, the host's memory shared by the
    ranks), and the one line that says which; as it is (and None) otherwise. `seq_len`: the longest sequence;
    `generation`: where an engine sits ("colocated", "separate" or "none")."""
    if training.parallel != "auto":
        return training, None
    if training.backend == "torch":
        return training.model_copy(update={"parallel": ParallelConfig()}), None
    from reinforge.training.parallel.planner import auto_layout

    check_auto_layout(training, num_gpus_per_worker)
    if torch.cuda.is_available():
        device, memory_gb = "gpu", torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        device, memory_gb = "cpu", host_bytes / 2**30 / training.num_workers
    tokens = training.micro_batch_tokens if getattr(training, "micro_batch_tokens", None) else seq_len
    located = model_config.model_copy(update={"name_or_path": model_location(model_config)})
    layout = auto_layout(
        located, training.num_workers, memory_gb, seq_len, training.activation_checkpointing,
        micro_batch_tokens=tokens, logprob_chunk_tokens=training.logprob_chunk_tokens, kl=kl,
        generation=generation, device=device,
    )  # fmt: skip
    parallel = ParallelConfig(**layout)
    line = (
        f"training.parallel=auto: {f'pp={parallel.pp} ' if parallel.pp > 1 else ''}dp_replicate="
        f"{parallel.dp_replicate} dp_shard={parallel.dp_shard} tp={parallel.tp} cp={parallel.cp}"
        f"{f' ep={parallel.ep}' if parallel.ep > 1 else ''} for {training.num_workers} ranks of {memory_gb:.0f} GiB "
        f"({device})"
    )
    return training.model_copy(update={"parallel": parallel}), line
