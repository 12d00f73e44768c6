"""One rank of the FSDP2 training backend: a plain Python class, one instance per process.

Every rank holds a 1/N shard of the policy (PyTorch FSDP2 `fully_shard` on each decoder layer, then
on the root) and of its AdamW state. Callers hand every rank the WHOLE global batch; rank r trains on
the contiguous rows [r*B/N, (r+1)*B/N) but divides by the normalisers of the whole batch, and the
gradient reduction is a plain sum (FSDP2's default average over ranks is switched off), so the summed
gradient is exactly the gradient of the global-batch loss, as in `TorchBackend`. Metrics are reduced
over ranks the same way (sums, and max/min for `*_max`/`*_min`); grad_norm is the global norm.

With `model.lora` PEFT injects its adapters into the Hugging Face model before sharding, so the
per-layer `fully_shard` shards them with their layer; only they get gradients, AdamW state and
clipping, the reference is the same sharded model with the adapters disabled, refit weights are
gathered then merged (W + (alpha / r) B A, training/lora.py), and checkpoints hold the adapter and
its AdamW state only, under the same names as the torch backend's (`model.layers.0.self_attn.q_proj.
lora_A.default.weight`), so `reinforge convert` reads either.

Master weights and optimizer state are always fp32; forward/backward run in `model.dtype` (float32
on CPU, bfloat16 on GPU) through FSDP2's MixedPrecisionPolicy, and gradients are reduced in fp32.
Ray is not imported here: the cluster layer wraps this class in actors.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from reinforge.config.schema import ModelConfig, TrainingConfig
from reinforge.data.batch import TrainBatch
from reinforge.errors import ConfigError
from reinforge.modeling import DTYPES, compile_decoder_layers, enable_activation_checkpointing, load_model
from reinforge.training.lora import adapter_state_dict, is_adapter_key, load_policy, merge_lora_weights, scaling
from reinforge.training.micro_batching import HiddenStates, Prompts, plan_micro_batches, select_micro_batch, split_to
from reinforge.training.torch_backend import PolicyPasses, build_optimizer


def shard_model(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
) -> PreTrainedModel:
    """FSDP2 on each decoder layer, then the root (embeddings, final norm and the tied lm_head).

    Gradients are SUM-reduced: the loss is already divided by the global token count, so FSDP2's
    default division by the world size would shrink the gradient N-fold. `set_gradient_divide_factor`
    acts on one module only, hence the loop; sum-only collectives avoid PREMUL_SUM, which gloo lacks.
    """
    offload_policy = offload_policy or OffloadPolicy()  # the base class means "no offload"
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    return replace(
        batch,
        **{
            f.name: value.to(device) for f in fields(batch) if isinstance(value := getattr(batch, f.name), torch.Tensor)
        },
    )


def reduce_metrics(
    totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor], device: torch.device
) -> dict[str, float]:
    """Sum `totals` and take the max/min of `extremes` over ranks (every rank has the same names)."""
    result = {}
    for names, op in (
        (sorted(totals), dist.ReduceOp.SUM),
        (sorted(n for n in extremes if n.endswith("_max")), dist.ReduceOp.MAX),
        (sorted(n for n in extremes if n.endswith("_min")), dist.ReduceOp.MIN),
    ):
        if not names:
            continue
        values = torch.stack([(totals | extremes)[n].float().to(device) for n in names])
        dist.all_reduce(values, op=op)
        result.update(zip(names, values.tolist()))
    return result


def gather(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor of a (sharded) state dict whole, on the CPU (a collective: every rank calls it with the
    same names); names bound to one tensor object stay bound to one."""
    gathered: dict[int, torch.Tensor] = {}
    for tensor in state_dict.values():
        if id(tensor) not in gathered:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            gathered[id(tensor)] = full.detach().cpu()
    return {name: gathered[id(tensor)] for name, tensor in state_dict.items()}


class FSDP2Worker(PolicyPasses):
    """One rank: sharded policy (+ optional frozen sharded reference; with LoRA the policy with its
    adapters disabled), AdamW over the trainable parameters and its schedule."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_config: ModelConfig,
        training_config: TrainingConfig,
        temperature: float,
        num_optimizer_steps: int,
        load_reference: bool,
    ):
        self.rank, self.world_size = rank, world_size
        self.config, self.lora = training_config, model_config.lora
        self.temperature = temperature
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            # under Ray each actor usually sees one GPU; LOCAL_RANK covers torchrun-style launches
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
        )
        mesh = init_device_mesh(self.device.type, (world_size,))
        # fp32 master weights; forward/backward in the configured dtype, gradients reduced in fp32
        mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[model_config.dtype], reduce_dtype=torch.float32)
        if training_config.cpu_offload and not on_gpu:
            raise ConfigError(
                "training.cpu_offload=true offloads GPU memory to the CPU; this worker has no GPU, so set it to false"
            )
        # sharded parameters, gradients and AdamW state stay in CPU memory; the optimizer steps there
        offload_policy = CPUOffloadPolicy() if training_config.cpu_offload else None
        fp32_config = model_config.model_copy(update={"dtype": "float32"})
        policy, self.peft = self._load_trained_model(
            fp32_config
        )  # with LoRA: PEFT's adapters injected, the rest frozen
        if training_config.activation_checkpointing:
            enable_activation_checkpointing(policy)  # before sharding: FSDP2 wraps the checkpointed layers
        if training_config.compile:
            compile_decoder_layers(policy)
        # with offload FSDP2 moves the shards to CPU itself and unshards onto the GPU for compute
        self.model = shard_model(policy if offload_policy else policy.to(self.device), mesh, mp_policy, offload_policy)
        self.model.train()
        self.reference = None
        if load_reference and self.peft is None:
            reference = load_model(fp32_config).requires_grad_(False)
            if training_config.compile:
                compile_decoder_layers(reference)
            self.reference = shard_model(
                reference if offload_policy else reference.to(self.device), mesh, mp_policy, offload_policy
            ).eval()
        self.hidden = {id(m): HiddenStates(m) for m in (self.model, self.reference) if m is not None}
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.trainable, training_config, num_optimizer_steps)
        # checkpoints skip the frozen base (the model's files hold it); load_state then fills only the adapter
        self.state_options = StateDictOptions(ignore_frozen_params=self.peft is not None, strict=self.peft is None)

    def _load_trained_model(self, model_config: ModelConfig):
        """(the model to train, its PeftModel or None), before sharding; a subclass adds modules here (the critic's value head)."""
        return load_policy(model_config)

    def _share(self, batch: TrainBatch, rank: int | None = None) -> tuple[int, int]:
        """The contiguous rows of `rank` (this one's by default); equal shares keep the ranks' collectives in step."""
        assert len(batch) % self.world_size == 0, (
            f"batch of {len(batch)} rows does not split over {self.world_size} ranks"
        )
        size = len(batch) // self.world_size
        rank = self.rank if rank is None else rank
        return rank * size, (rank + 1) * size

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[list[int], TrainBatch, list[list[int]]]]:
        """(indices within the share, micro-batch on this device, its rows) over this rank's share. Every
        rank plans every share and splits its own micro-batches up to the largest count: FSDP2's
        collectives need the same number of forward (and backward) passes on every rank."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        prompts = Prompts.of(batch, self.config)
        shares = [self._share(batch, rank) for rank in range(self.world_size)]
        plans = [
            plan_micro_batches(lengths[start:end], self.config, prompts and prompts.slice(start, end))
            for start, end in shares
        ]
        share_batch = batch.slice(*shares[self.rank])
        for rows in split_to(plans[self.rank], max(len(plan) for plan in plans)):
            micro, local_rows, indices = select_micro_batch(share_batch, rows)
            yield indices, batch_to(micro, self.device), local_rows

    def _per_token(
        self, batch: TrainBatch, compute: Callable[[TrainBatch, list[list[int]]], torch.Tensor]
    ) -> torch.Tensor:
        """`compute(micro, rows)` ([b, t] per micro-batch of this rank's share) assembled into the whole
        batch's [B, T] on every rank (a collective), 0 off `batch.loss_mask`."""
        start, end = self._share(batch)
        share_BT = torch.zeros((end - start, batch.loss_mask.shape[1]), device=self.device)
        for indices, micro, rows in self._micro_batches(batch):
            values_BT = compute(micro, rows)
            share_BT[indices, : values_BT.shape[1]] = values_BT
        shares = [torch.empty_like(share_BT) for _ in range(self.world_size)]
        dist.all_gather(shares, share_BT)
        return torch.cat(shares).cpu() * batch.loss_mask

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every rank's shards."""
        parameters = [p for p in self.trainable if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        if isinstance(grad_norm, DTensor):  # each rank's norm of its shard, pending a reduction
            grad_norm = grad_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, grad_norm)
        return grad_norm

    def _reduce_metrics(self, totals: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> dict[str, float]:
        return reduce_metrics(totals, extremes, self.device)

    @torch.no_grad()
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 weights with HF names on every rank (a collective: all ranks must iterate); with LoRA
        the merged weights, computed from the gathered base and adapters (the sharded base is left as it is).

        Tied parameters (lm_head and embed_tokens) appear under both names as the same tensor object,
        so `save_pretrained` recognises the tie and writes it once."""
        weights = gather(self.model.state_dict(keep_vars=True))  # keep_vars: tied names share one object
        yield from (merge_lora_weights(weights, scaling(self.lora)) if self.peft is not None else weights).items()

    def full_state(self) -> list[tuple[str, torch.Tensor]]:
        """`named_weights` as a list on rank 0 (empty elsewhere): what a remote caller fetches for refit."""
        weights = list(self.named_weights())
        return weights if self.rank == 0 else []

    def save_pretrained(self, path: Path) -> None:
        """Every rank gathers; rank 0 writes the Hugging Face directory (with LoRA, the adapter in PEFT's format)."""
        if self.peft is not None:
            return self.save_adapter(path)
        state_dict = dict(self.named_weights())
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state_dict)
        dist.barrier()

    @torch.no_grad()
    def save_adapter(self, path: Path) -> None:
        """The LoRA adapter in PEFT's format: every rank gathers the adapter's tensors, rank 0 writes them."""
        adapter = gather(adapter_state_dict(self.model))
        if self.rank == 0:  # PEFT's names are the PeftModel's: the Hugging Face model's under base_model.model
            self.peft.save_pretrained(
                path, state_dict={f"base_model.model.{name}": tensor for name, tensor in adapter.items()}
            )
        dist.barrier()

    def memory(self) -> dict[str, float]:
        """This rank's peak host (and GPU) memory, GiB."""
        from reinforge.logging.memory import memory_metrics

        return memory_metrics(prefix="")

    def _state(self) -> dict:
        """The sharded policy and AdamW state for torch.distributed.checkpoint; with LoRA the adapter's only
        (`ignore_frozen_params` alone would keep the frozen embedding under its tied second name, lm_head)."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self.state_options)
        if self.peft is not None:
            model_state = {name: tensor for name, tensor in model_state.items() if is_adapter_key(name)}
        return {"model": model_state, "optimizer": optimizer_state}

    def save_state(self, path: str) -> None:
        """Sharded policy and AdamW state (torch.distributed.checkpoint: each rank writes its own shards;
        on several nodes `path` must be on a shared filesystem) and the LR schedule's position."""
        dcp.save(self._state(), checkpoint_id=path)
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(path) / "scheduler.pt")
        dist.barrier()

    def load_state(self, path: str) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self.state_options,
        )
        self.scheduler.load_state_dict(torch.load(Path(path) / "scheduler.pt", weights_only=False))

    def shutdown(self) -> None:
        dist.destroy_process_group()
