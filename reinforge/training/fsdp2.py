"""FSDP2 ranks: the training backend's strategy on one of N ranks, in that rank's process.

Every rank holds a 1/N shard of the model (PyTorch FSDP2 `fully_shard` on each decoder layer, then on the
root) and of its AdamW state. Callers hand every rank the WHOLE global batch; rank r trains on the contiguous
rows [r*B/N, (r+1)*B/N) but divides by the normalisers of the whole batch, and the gradient reduction is a
plain sum (FSDP2's default average over ranks is switched off), so the summed gradient is exactly the
gradient of the global-batch loss, as in one process. Metrics are reduced over ranks the same way (sums, and
max/min for `*_max`/`*_min`); grad_norm is the global norm.

With `model.lora` PEFT injects its adapters into the Hugging Face model before sharding, so the per-layer
`fully_shard` shards them with their layer; only they get gradients, AdamW state and clipping, refit weights
are gathered then merged (training/lora.py), and checkpoints hold the adapter and its AdamW state only, under
the same names as one process's (`model.layers.0.self_attn.q_proj.lora_A.default.weight`), so
`reinforge convert` reads either. A value head (PPO's critic) sits on the root module, beside the embeddings,
and is left whole after the root's forward for the head to be applied after the decoder, as the LM head is.

With `training.parallel.ep` a mixture-of-experts model's experts are split over ranks and its tokens sent to
them (training/parallel/expert.py); their FSDP2 shards are on a mesh of their own, with the same SUM reduction.
With `training.parallel.pp` each rank holds one pipeline stage's layers (split before tensor parallelism and
FSDP2) and runs its micro-batches through the schedule (training/parallel/pipeline.py); the last stage's per-token
outputs and metrics are sent to the others, and the gradient norm is summed over the stages.

Master weights and optimizer state are always fp32; forward/backward run in `model.dtype` (float32 on CPU,
bfloat16 on GPU) through FSDP2's MixedPrecisionPolicy, and gradients are reduced in fp32. Ray is not imported
here: the cluster layer runs one `Backend` with an `FSDP2Strategy` per actor.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from transformers import PreTrainedModel

from reinforge.data.batch import TrainBatch
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.modeling import DTYPES, is_vision_language
from reinforge.training import state
from reinforge.training.base import TrainingConfig
from reinforge.training.lora import adapter_state_dict, is_adapter_key
from reinforge.training.micro_batching import Prompts, select_micro_batch, split_to
from reinforge.training.numerics import local
from reinforge.training.parallel import pipeline_weights
from reinforge.training.parallel.context import split_context
from reinforge.training.parallel.expert import expert_fsdp_mesh, expert_mesh, expert_modules, shard_experts
from reinforge.training.parallel.layout import ParallelConfig, build_mesh, check_layout, clip_gradients, fsdp_mesh
from reinforge.training.parallel.pipeline import (
    check_staged_moe,
    pipeline_plan,
    pipeline_stage,
    run_pipeline,
    split_stage,
)
from reinforge.training.parallel.tensor_plan import tensor_parallelize
from reinforge.training.strategy import Compute, MicroBatch, MicroLoss, Plan, batch_to, run_passes


def shard_model(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    experts_mesh: DeviceMesh | None = None,
) -> PreTrainedModel:
    """FSDP2 on each transformer block (`transformer_blocks`), then the root (embeddings, final norm and the tied
    lm_head; a vision-language model's projector); with
    `experts_mesh` (expert parallelism) first on each experts module, whose weights are sharded over `ep` already
    (training/parallel/expert.py), on that mesh of the other data-parallel ranks.

    Gradients are SUM-reduced: the loss is already divided by the global token count, so FSDP2's
    default division by the world size would shrink the gradient N-fold. `set_gradient_divide_factor`
    acts on one module only, hence the loop; sum-only collectives avoid PREMUL_SUM, which gloo lacks.
    """
    offload_policy = offload_policy or OffloadPolicy()  # the base class means "no offload"
    for experts in expert_modules(model) if experts_mesh is not None else ():
        fully_shard(experts, mesh=experts_mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for layer in [block for block in transformer_blocks(model) if any(True for _ in block.parameters())]:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every `layers` (or `blocks`) list of the model: a causal LM's decoder layers; a vision-language
    model's decoder layers and its vision encoder's layers too."""
    return [
        block
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks")
        for block in module
    ]


def reduce_metrics(
    totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor], device: torch.device, group=None
) -> dict[str, float]:
    """Sum `totals` and take the max/min of `extremes` over the ranks of `group` (all by default; every rank has
    the same names)."""
    result = {}
    for names, op in (
        (sorted(totals), dist.ReduceOp.SUM),
        (sorted(n for n in extremes if n.endswith("_max")), dist.ReduceOp.MAX),
        (sorted(n for n in extremes if n.endswith("_min")), dist.ReduceOp.MIN),
    ):
        if not names:
            continue
        values = torch.stack([(totals | extremes)[n].float().to(device) for n in names])
        dist.all_reduce(values, op=op, group=group)
        result.update(zip(names, values.tolist()))
    return result


def gather(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor of a (sharded) state dict whole, on the CPU (a collective: every rank calls it with the
    same names); names bound to one tensor object stay bound to one. Always a copy: on the CPU a replicated
    DTensor's `full_tensor` (or a plain tensor) is the parameter's own storage, which the next step changes."""
    gathered: dict[int, torch.Tensor] = {}
    for tensor in state_dict.values():
        if id(tensor) not in gathered:
            whole = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            own = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage().data_ptr()
            gathered[id(tensor)] = whole.to("cpu", copy=whole.untyped_storage().data_ptr() == own)
    return {name: gathered[id(tensor)] for name, tensor in state_dict.items()}


class FSDP2Strategy:
    """Rank `rank` of `world_size` (gloo on CPU, NCCL on GPU, rendezvous at master_addr:master_port); `setup`
    starts the process group, in the rank's own process."""

    is_main, pipelined = False, False

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int):
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.is_main = rank == 0
        self.full_layouts: dict[int, pipeline_weights.FullLayout] = {}  # by id(model), at pp > 1

    def setup(self, training: TrainingConfig) -> TrainingConfig:
        if not isinstance(training.parallel, ParallelConfig):
            raise ConfigError("training.parallel=auto must be resolved by the planner before the ranks start")
        self.parallel = training.parallel.resolved(self.world_size)
        self.config = training = training.model_copy(update={"parallel": self.parallel})
        on_gpu = torch.cuda.is_available() and training.device != "cpu"  # training.device=cpu: gloo even beside GPUs
        if on_gpu:
            # under Ray each actor usually sees one GPU; LOCAL_RANK covers torchrun-style launches
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank % torch.cuda.device_count())))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if training.cpu_offload and not on_gpu:
            raise ConfigError(
                "training.cpu_offload=true offloads GPU memory to the CPU; this worker has no GPU, so set it to false"
            )
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=training.collective_timeout_s),
        )
        self.mesh = build_mesh(self.device.type, self.parallel)
        # the ranks with distinct shares of each batch; tp and cp ranks of one share compute the same outputs
        self.dp_group, self.dp_rank = self.mesh["dp"].get_group(), self.mesh["dp"].get_local_rank()
        # expert parallelism: `dp_shard_cp` unflattened into (edp_shard, ep) for the experts' weights
        self.expert_mesh = expert_mesh(self.mesh, self.parallel) if self.parallel.ep > 1 else None
        # pipeline stages (parallel/pipeline.py): this rank's stage, its pipeline's ranks, the last stage's rank
        self.pp_group, self.pp_rank = self.mesh["pp"].get_group(), self.mesh["pp"].get_local_rank()
        self.pipelined, self.last_stage = (
            self.parallel.pp > 1,
            dist.get_global_rank(self.pp_group, self.parallel.pp - 1),
        )
        self.tied_group, self.tied = tied_group(self.mesh, self.parallel.pp), set()
        # sharded parameters, gradients and AdamW state stay in CPU memory; the optimizer steps there
        self.offload_policy = CPUOffloadPolicy() if training.cpu_offload else None
        return training

    def load_config(self, model_config: ModelConfig) -> ModelConfig:
        """fp32 master weights; forward/backward in the configured dtype, gradients reduced in fp32."""
        if self.pipelined:
            check_staged_moe(model_config.moe)
        self.dtype = DTYPES[model_config.dtype]
        self.mp_policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        return model_config.model_copy(update={"dtype": "float32"})

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        # with offload FSDP2 moves the shards to CPU itself and unshards onto the GPU for compute
        placed = model if self.offload_policy else model.to(self.device)
        lora = any(is_adapter_key(name) for name, _ in model.named_parameters())
        stateful = getattr(model, "_is_stateful", False)
        check_layout(self.parallel, model.config.get_text_config(), stateful, lora, is_vision_language(model.config))
        if self.pipelined:  # this stage's layers only, before tensor parallelism and FSDP2 (parallel/pipeline.py)
            split_stage(placed, self.pp_rank, self.parallel.pp)
        if self.parallel.tp > 1:
            tensor_parallelize(placed, self.mesh["tp"])
        if self.parallel.cp > 1:  # its forward passes run on this rank's chunk of each row (parallel/context.py)
            split_context(placed, self.mesh["cp"].get_group())
        experts_mesh = None
        if self.expert_mesh is not None:  # each rank's experts, tokens sent to them (training/parallel/expert.py)
            tensor_parallel = self.parallel.tp > 1  # the experts split over (ep, tp) then
            shard_experts(placed, self.expert_mesh["ep", "tp"] if tensor_parallel else self.expert_mesh["ep"])
            experts_mesh = expert_fsdp_mesh(self.expert_mesh, self.parallel)
        mesh = fsdp_mesh(self.mesh, self.parallel)
        sharded = shard_model(placed, mesh, self.mp_policy, self.offload_policy, experts_mesh)
        if self.pipelined and pipeline_stage(sharded).tied:  # this stage's copy of the tied embedding
            copy = sharded.get_input_embeddings() if self.pp_rank == 0 else sharded.get_output_embeddings()
            self.tied.add(id(copy.weight))
        return sharded

    def _share(self, batch: TrainBatch, rank: int | None = None) -> tuple[int, int]:
        """The contiguous rows of data-parallel rank `rank` (this one's by default); equal shares keep the ranks'
        collectives in step."""
        shares = self.parallel.data_parallel
        assert len(batch) % shares == 0, f"batch of {len(batch)} rows does not split over {shares} data-parallel ranks"
        size = len(batch) // shares
        rank = self.dp_rank if rank is None else rank
        return rank * size, (rank + 1) * size

    def micro_batches(self, batch: TrainBatch, plan: Plan) -> Iterator[MicroBatch]:
        """(indices within the share, micro-batch on this device, its rows) over this rank's share. Every rank
        plans every share and splits its own micro-batches up to the largest count: FSDP2's collectives need the
        same number of forward (and backward) passes on every rank."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        prompts = Prompts.of(batch, self.config)
        shares = [self._share(batch, rank) for rank in range(self.parallel.data_parallel)]
        plans = [plan(lengths[start:end], prompts and prompts.slice(start, end)) for start, end in shares]
        share_batch = batch.slice(*shares[self.dp_rank])
        count = max(len(p) for p in plans)
        if self.pipelined:  # `pp_microbatches`, or at least one per stage (1F1B's least)
            count = self.parallel.pp_microbatches or max(count, self.parallel.pp)
        for rows in (pipeline_plan if self.pipelined else split_to)(plans[self.dp_rank], count):
            micro, local_rows, indices = select_micro_batch(share_batch, rows)
            yield indices, batch_to(micro, self.device), local_rows

    def per_token(self, batch: TrainBatch, plan: Plan, compute: Compute, model=None) -> torch.Tensor:
        """This rank's share computed, then the whole batch's [B, T] gathered on every rank (a collective). With
        pipeline stages `model`'s last stage computes it, and sends it to the others."""
        start, end = self._share(batch)
        share_BT = torch.zeros((end - start, batch.loss_mask.shape[1]), device=self.device)

        def store(indices, micro, rows) -> torch.Tensor:
            values_BT = compute(micro, rows)
            share_BT[indices, : values_BT.shape[1]] = values_BT
            return values_BT.new_zeros(())

        if self.pipelined:
            self.pipeline(model, batch, plan, store, backward=False)
        else:
            for indices, micro, rows in self.micro_batches(batch, plan):
                store(indices, micro, rows)
        shares = [torch.empty_like(share_BT) for _ in range(self.parallel.data_parallel)]
        dist.all_gather(shares, share_BT, group=self.dp_group)
        whole_BT = torch.cat(shares)
        if self.pipelined:
            dist.broadcast(whole_BT, src=self.last_stage, group=self.pp_group)
        return whole_BT.cpu() * batch.loss_mask

    def passes(self, model: torch.nn.Module, batch: TrainBatch, plan: Plan, loss: MicroLoss, backward: bool) -> None:
        """This rank's micro-batches' losses (and backward), one after another, or through the pipeline's schedule
        (parallel/pipeline.py): `loss` runs on the last stage."""
        if self.pipelined:
            self.pipeline(model, batch, plan, loss, backward)
        else:
            run_passes(self.micro_batches(batch, plan), loss, backward)

    def pipeline(self, model, batch: TrainBatch, plan: Plan, finish: MicroLoss, backward: bool) -> None:
        """This rank's micro-batches through the pipeline's schedule (parallel/pipeline.py); on the last stage
        `finish(indices, micro, rows)` gives each one's loss (differentiated with `backward`), or stores its
        outputs."""
        items = list(self.micro_batches(batch, plan))
        # The heads run on the root's weights outside its forward, and a schedule may run several forwards before
        # a backward (GPipe): the root stays unsharded until the pass ends, not just until its next backward.
        model.set_reshard_after_backward(False, recurse=False)
        try:
            run_pipeline(
                model,
                [(micro, rows) for _, micro, rows in items],
                self.config,
                lambda i: finish(*items[i]),
                backward,
                self.pp_group,
                self.device,
                self.dtype,
                self.parallel.pp_schedule,
            )
        finally:
            model.set_reshard_after_backward(True, recurse=False)
            model.reshard()

    def clip_gradients(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm over every rank's shards (and every stage's: a tied embedding's two copies given their
        summed gradient first, and counted once)."""
        if not self.pipelined:
            return clip_gradients(parameters, max_norm)
        uncounted = frozenset(id(p) for p in parameters if id(p) in self.tied and self.pp_rank != 0)
        for param in [p for p in parameters if id(p) in self.tied]:
            if param.grad is None:  # a copy no head read (a critic's LM head): the other copy's gradient is its own
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local(param.grad), group=self.tied_group)
        return clip_gradients(parameters, max_norm, self.pp_group, uncounted)

    def reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        """Over the data-parallel ranks; with pipeline stages the last stage's (where the loss is), sent to all."""
        if not self.pipelined:
            return reduce_metrics(totals, extremes, self.device, self.dp_group)
        last = self.pp_rank == self.parallel.pp - 1
        result = [reduce_metrics(totals, extremes, self.device, self.dp_group) if last else None]
        dist.broadcast_object_list(result, src=self.last_stage, group=self.pp_group, device=self.device)
        return result[0]

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        """Over every rank of the world (tensor- and context-parallel peers too: each holds shards of its own)."""
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        return values

    def gather_objects(self, value) -> list:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def count_parameters(self, model: torch.nn.Module, trainable: list[torch.nn.Parameter]) -> tuple[int, int]:
        """Whole-model counts (a DTensor counts its full shape); at pp > 1 every stage's, summed over the pipeline
        group, a tied embedding's second copy not counted (one process holds one tensor)."""
        own = [
            [p for p in params if not (id(p) in self.tied and self.pp_rank != 0)]
            for params in (model.parameters(), trainable)
        ]
        counts = torch.tensor([sum(p.numel() for p in params) for params in own], device=self.device)
        if self.pipelined:
            dist.all_reduce(counts, group=self.pp_group)
        return counts[0].item(), counts[1].item()

    def full_state_dict(self, model: torch.nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Full fp32 weights (of `names` only, when given: one process's names) on every rank (a collective); tied
        names share one object. Pipeline stages: each name's owner stage gathers it and broadcasts it to the
        others (parallel/pipeline_weights.py)."""
        if self.parallel.pp > 1:
            layout = self._full_layout(model)
            return pipeline_weights.full_state_dict(model, names, layout, self.pp_group, self.pp_rank, self.device)
        state_dict = model.state_dict(keep_vars=True)
        return gather(state_dict if names is None else {name: state_dict[name] for name in names})

    def state_names(self, model: torch.nn.Module) -> list[str]:
        """One process's state-dict names of the model (every stage's, in order, at pp > 1: a collective the first
        time)."""
        if self.parallel.pp > 1:
            return list(self._full_layout(model).names)
        return list(model.state_dict())

    def _full_layout(self, model: torch.nn.Module) -> pipeline_weights.FullLayout:
        if id(model) not in self.full_layouts:
            self.full_layouts[id(model)] = pipeline_weights.full_layout(model, self.pp_group)
        return self.full_layouts[id(model)]

    def save_pretrained(self, model: torch.nn.Module, path: Path) -> None:
        """Every rank gathers; rank 0 writes the Hugging Face directory."""
        state_dict = self.full_state_dict(model)
        if self.is_main:
            model.save_pretrained(path, state_dict=state_dict)
        dist.barrier()

    @torch.no_grad()
    def save_adapter(self, model: torch.nn.Module, peft: torch.nn.Module, path: Path) -> None:
        """The LoRA adapter in PEFT's format: every rank gathers the adapter's tensors, rank 0 writes them."""
        if self.parallel.pp > 1:  # each stage's adapters, by one process's names
            adapter = self.full_state_dict(model, [name for name in self.state_names(model) if is_adapter_key(name)])
            if self.is_main:
                pipeline_weights.save_adapter(peft, adapter, path)
        else:
            adapter = gather(adapter_state_dict(model))
            if self.is_main:  # PEFT's names are the PeftModel's: the Hugging Face model's under base_model.model
                peft.save_pretrained(path, state_dict={f"base_model.model.{name}": t for name, t in adapter.items()})
        dist.barrier()

    def save_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
        """The checkpoint format of every layout (training/state.py): each rank writes its own shards (on several
        nodes `path` must be on a shared filesystem), rank 0 the LR schedule's position."""
        state.save_state(model, optimizer, scheduler, path, adapter_only, self.is_main, distributed=True)

    def load_state(self, model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
        """A checkpoint written under any layout, each rank reading the pieces its shards cover."""
        state.load_state(model, optimizer, scheduler, path, adapter_only, distributed=True)

    def shutdown(self) -> None:
        dist.destroy_process_group()
        # DTensor caches its ops' shardings by mesh, and meshes compare by their ranks' layout, not their process
        # groups: a later group in this process (a test's next layout) would otherwise reuse this one's mesh, and a
        # collective on one of its destroyed groups
        _clear_sharding_prop_cache()


def tied_group(mesh: DeviceMesh, pp: int):
    """The group of each pipeline's first and last stage (a tied embedding's two copies): the pp group at pp=2,
    a group of two per pipeline beyond (every rank creates every pipeline's, in one order)."""
    if pp <= 2:
        return mesh["pp"].get_group()
    mine = None
    for column in mesh.mesh.reshape(pp, -1).T.tolist():
        group = dist.new_group([column[0], column[-1]])
        mine = group if dist.get_rank() in column else mine
    return mine
