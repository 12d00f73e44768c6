"""The training backend interface.

A training backend owns the policy being trained (and the frozen reference policy when the KL term
needs it). It computes logprobs, takes optimizer steps with a loss function it is handed, gives out
its weights for refit, and exports them in Hugging Face format. The loss is a pure function of
tensors (see `algorithms/losses.py`), so the backend never knows which algorithm it trains. The one
implementation is `training/backend.py`'s `Backend` (in this process, or one per FSDP2 rank behind
cluster/fsdp2_trainer.py's `FSDP2Trainer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Literal, Protocol

import torch
from pydantic import Field, model_validator

from reinforge.config.section import Section
from reinforge.data.batch import Normalisers, TrainBatch
from reinforge.modeling import DEVICE_PATTERN
from reinforge.training.parallel.layout import ParallelConfig, ParallelSetting


class BackendConfig(Section):
    """The training backend's settings that every recipe reads: where the model trains and how it computes. Each
    recipe's `training:` section adds how its batches become micro-batches (`TrainingConfig` for the RL recipes,
    sft.py's and pairs.py's own), and hands the backend a `TrainingConfig`."""

    backend: Literal["torch", "fsdp2"] = "torch"
    """Training engine: `torch` (one process, plain PyTorch) or `fsdp2` (PyTorch FSDP2 over
    `training.num_workers` ranks in Ray actors; gloo on CPU, NCCL on GPU)."""
    device: str = Field(default="auto", pattern=DEVICE_PATTERN)
    """Where the `torch` backend trains: `auto` (the first CUDA GPU this process sees, else the CPU), `cpu`, `cuda`
    or `cuda:N`; a CUDA device that is absent is a one-line error. `fsdp2` ranks take their own GPU where Ray gives
    them one (`cluster.num_gpus_per_worker`); `cpu` keeps them on the CPU (gloo) even then."""
    num_workers: int = Field(default=1, ge=1)
    """Training ranks for `fsdp2`; each trains on global_batch_size / num_workers sequences per step."""
    global_batch_size: int = 128
    """Sequences per optimizer step (RL: it must divide the rollout batch, prompts x generations)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    activation memory drops from O(layers) to O(1) layers for about a third more compute."""
    compile: bool = False
    """`torch.compile` each decoder layer and the LM head's logprob chunks: Inductor fuses the
    memory-bound work between the matmuls (norms, SwiGLU, rotary embedding; the upcast, log-sum-exp and
    entropy over the vocabulary). Worth it on GPUs (docs/benchmarks.md has the measured gain); the
    first steps pay the compilation, and small models on CPU gain nothing."""
    cpu_offload: bool = False
    """`fsdp2` on GPU: keep the sharded fp32 parameters, gradients and AdamW state in CPU memory and
    run the optimizer step there (FSDP2 CPUOffloadPolicy); frees GPU memory for 70B-class models."""
    collective_timeout_s: float = Field(default=900.0, gt=0)
    """`fsdp2`: the longest a rank waits in a torch.distributed collective (or at the rendezvous) for the other
    ranks; then the collective raises on that rank and the run stops (torch.distributed's own default is 10 to 30
    minutes). A hung rank is usually caught earlier by `cluster.worker_timeout_s`."""
    max_nonfinite_steps: int = Field(default=3, ge=1)
    """An optimizer step whose loss or gradient norm is NaN or infinite is skipped (no update, the schedule does not
    advance; `train/nonfinite_steps` counts it); the run stops with one line naming the step, the micro-batch and
    the quantity at the this-many-th such step in a row (1: at the first). 3 rides out a rare bad batch and stops a
    diverged run within three steps (docs/reliability.md, "Numerical faults")."""
    parallel: ParallelSetting = ParallelConfig()
    """How `num_workers` ranks split the work: data-parallel shards and copies, tensor and context parallelism
    (training/parallel/layout.py; docs/distributed.md); `auto`: the layout the planner picks for the model and the
    machine (training/parallel/planner.py)."""
    logprob_chunk_tokens: int = Field(default=2048, ge=1)
    """Apply the LM head to at most this many tokens at a time when computing logprobs and entropies (the
    training pass recomputes each chunk's logits in the backward pass), so memory grows with
    chunk x vocabulary, not with sequence length x vocabulary."""

    @model_validator(mode="after")
    def _check_backend(self) -> "BackendConfig":
        """The backend's rules, for every recipe: ranks and CPU offload need FSDP2; the layout fits the ranks."""
        if self.num_workers > 1 and self.backend != "fsdp2":
            raise ValueError(
                f"training.num_workers={self.num_workers} needs training.backend=fsdp2; the torch backend is one "
                "process"
            )
        if self.cpu_offload and self.backend != "fsdp2":
            raise ValueError("training.cpu_offload=true needs training.backend=fsdp2 (FSDP2's CPUOffloadPolicy)")
        if not isinstance(self.parallel, ParallelConfig):
            return self
        if self.backend == "torch":
            if not self.parallel.is_plain() or self.parallel.dp_replicate > 1 or self.parallel.dp_shard > 1:
                raise ValueError(
                    "training.parallel splits the model over ranks, which training.backend=torch (one process) "
                    "does not have; set training.backend=fsdp2 and training.num_workers"
                )
        else:
            self.parallel.resolved(self.num_workers)  # the dimensions multiply to the ranks, or a one-line error
        return self


class TrainingConfig(BackendConfig):
    """`training:` of the RL recipes (GRPO, PPO, distillation), and what the backend reads of any recipe's."""

    micro_batch_size: int = 32
    """Sequences per forward/backward pass; gradients accumulate over micro-batches."""
    sequence_packing: bool = True
    """Logprob and training passes: lay a micro-batch's sequences end to end in rows as wide as its
    longest sequence (first-fit decreasing), each attending to itself only (training/segment_attention.py,
    whatever the model's attention implementation), instead of one right-padded sequence per row, so no
    compute is spent on padding. Same logprobs, loss and gradients as unpacked
    (tests/unit/test_packing_rl.py)."""
    share_prompts: bool = True
    """With `sequence_packing`: lay the samples of one prompt in a row as the prompt once, then each
    response attending to it and to itself (training/segment_attention.py: each answer attends over its
    prompt and itself only, whatever the model's attention implementation), so the prompt's other
    copies are not computed; same logprobs, loss and gradients (tests/unit/test_packing_rl.py). All the
    samples of a prompt share one copy, or as many as fit in `micro_batch_tokens`."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Logprob and training passes: build micro-batches to this many computed positions (rows x row width,
    padding included) instead of `micro_batch_size` sequences, longest rows first; a sequence longer than the
    budget gets a micro-batch of its own. null: `micro_batch_size` sequences."""


# loss_fn(outputs_BT, micro_batch, normalisers) -> (loss, summable metric contributions). outputs_BT is the
# head's (the policy's logprobs, a critic's values), [B, T] like micro_batch.loss_mask and 0 off it: the backend
# computes them on the trained tokens only. A loss that needs more outputs declares them (training/backend.py, Loss).
LossFn = Callable[[torch.Tensor, TrainBatch, Normalisers], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainingBackend(Protocol):
    def logprobs(self, batch: TrainBatch, reference: bool = False, version: int | None = None) -> torch.Tensor:
        """Per-token logprobs [B, T] of the policy (or the reference policy, or an earlier policy version that
        `keep_version` kept), without gradients."""
        ...

    def keep_version(self, version: int, depth: int) -> list[int]:
        """Keep the trained parameters as policy `version` (the last `depth` versions); the versions kept."""
        ...

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, step: int | None = None) -> dict[str, float]:
        """One optimizer step on a global batch, accumulated over micro-batches, skipped when its loss or gradient
        norm is not finite (training/numerics.py); `step`: the loop's, which its messages name."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) policy weights with Hugging Face names, for refit and export."""
        ...

    def save_adapter(self, path: Path) -> None:
        """With `model.lora`: write the adapter in PEFT's format (for the engine's adapter sync and for export)."""
        ...

    def save_pretrained(self, path: Path) -> None:
        """Write the policy and tokenizer as a Hugging Face directory."""
        ...

    def save_state(self, path: Path) -> None:
        """Write everything an exact resume needs: policy weights, optimizer and LR-schedule state."""
        ...

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote (same model, same optimizer settings)."""
        ...

    def memory_metrics(self) -> dict[str, float]:
        """Memory metrics of the trainer's own processes (Ray ranks), beside the driver's; {} in the driver."""
        ...
