"""Numerical faults in training: a non-finite loss, gradient or parameter never reaches AdamW, a checkpoint or an
exported model.

The training backend (training/backend.py) checks every optimizer step before AdamW sees it: the loss of each
micro-batch and the global gradient norm, reduced over every rank (`Strategy.all_min`) so that all FSDP2 ranks
decide alike. A step with a non-finite one is skipped: its gradients are dropped, AdamW does not step and the
learning-rate schedule does not advance (the schedule counts the updates applied, so a skip never spends warm-up),
and it is counted (`train/nonfinite_steps`, cumulative). The `training.max_nonfinite_steps`-th skipped step in a row
stops the run with a `NumericalError` (exit 2, never restarted) naming the step, the micro-batch and the quantity.

A finite gradient can still make the parameters non-finite (`optimizer.lr=1e30`): after each step the trained
parameters are checked (one fused reduction over this rank's shards, then the minimum over the ranks), and since
that step cannot be undone cheaply the run stops at once, before any checkpoint. A checkpoint's state (the
parameters and AdamW's moments) and the exported weights are checked the same way before they are written, and the
counters go into the checkpoint (`numerics.json`) with a `finite` mark: false when it was saved while skipped steps
were in a row (its weights finite, the run heading for a stop: suspect). training/checkpoint.py keeps and resumes
from the newest finite checkpoint past any newer suspect one.

`REINFORGE_FAULT_NONFINITE_AT_STEP=<step>` (a testing hook, docs/reliability.md) makes every optimizer step of that
training step have NaN gradients, in whichever process (or Ray rank) trains.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from reinforge.errors import ConfigError, NumericalError

FAULT_ENV = "REINFORGE_FAULT_NONFINITE_AT_STEP"
NUMERICS_FILE = "numerics.json"
NONE = 2**62  # the code of "nothing non-finite": larger than any micro-batch or tensor index
INF = float("inf")


def warn(line: str) -> None:
    """A warning on the console (stdout: stderr is the dependency-log capture's, logging/capture.py)."""
    print(f"reinforge: warning: {line}", flush=True)


def fault_step() -> int | None:
    """The training step whose gradients `REINFORGE_FAULT_NONFINITE_AT_STEP` makes NaN (None: unset)."""
    value = os.environ.get(FAULT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"{FAULT_ENV}={value!r} must be a step number (a testing hook: docs/reliability.md)")
    return int(value)


def first_nonfinite(tensors: list[torch.Tensor], owners: list[int] | None = None, norm_type=2.0) -> torch.Tensor:
    """The owner (`owners[i]`, by default i) of the first tensor whose norm is not finite, NONE when there is none:
    one fused reduction, a 0-d int64 tensor on the tensors' device, with no wait for the device. The L2 norm (the
    fast one) is not finite for a NaN, an infinity, or values so large that their squares overflow float32 (above
    about 1.8e19 / sqrt(numel): `optimizer.lr=1e30` makes every weight about 1e30 in one AdamW step, finite, but no
    forward with them is; trained weights are orders of magnitude below it); `norm_type=inf` (the largest magnitude)
    flags a NaN or an infinity only, for what may rightly be large (AdamW's second moment, a gradient squared)."""
    owners = list(range(len(tensors))) if owners is None else owners
    present = [i for i, tensor in enumerate(tensors) if tensor.numel()]  # the infinity norm of nothing is undefined
    if not present:
        return torch.tensor(NONE)
    norms = torch._foreach_norm([tensors[i] for i in present], norm_type)
    bad = ~torch.isfinite(torch.stack([norm.float() for norm in norms]))
    owner = torch.tensor([owners[i] for i in present], device=bad.device)
    return torch.where(bad, owner, torch.full_like(owner, NONE)).min()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (FSDP2, tensor parallel), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class ParameterNames:
    """The names the ranks' parameter codes index, the same list on every rank, and each trained parameter's code:
    the trained names themselves, or at pp > 1 (each stage holding other parameters) one process's state-dict
    names, so that the least code over the ranks names the right parameter."""

    names: list[str]
    codes: list[int]

    @classmethod
    def of(cls, strategy, model: torch.nn.Module, trained: list[str]) -> "ParameterNames":
        if not strategy.pipelined:
            return cls(trained, list(range(len(trained))))
        position = {name: i for i, name in enumerate(strategy.state_names(model))}
        return cls(list(position), [position[name] for name in trained])

    def name(self, code: int) -> str | None:
        return self.names[code] if code < NONE else None


def nonfinite_parameter(strategy, names: ParameterNames, parameters: list[torch.Tensor], optimizer=None) -> str | None:
    """The name of the first parameter whose weights' norm is not finite (`first_nonfinite`; with `optimizer`: or whose
    AdamW moments hold a NaN or an infinity) on some rank, None when there is none: a fused reduction over this
    rank's shards, then the minimum over the ranks (`strategy.all_min`, a collective on FSDP2 ranks)."""
    first = first_nonfinite([local(p).detach() for p in parameters], names.codes).to(strategy.device)
    if optimizer is not None:
        states = [(code, optimizer.state.get(p, {})) for code, p in zip(names.codes, parameters)]
        moments = [(code, state[key]) for code, state in states for key in ("exp_avg", "exp_avg_sq") if key in state]
        owners = [i for i, _ in moments]
        moment = first_nonfinite([local(m).detach() for _, m in moments], owners, INF).to(strategy.device)
        first = torch.minimum(first, moment)
    return names.name(int(strategy.all_min(first.reshape(1))[0]))


def gradient_code(parameters: list[torch.Tensor], codes: list[int]) -> torch.Tensor:
    """The code (`ParameterNames`) of the first parameter whose gradient (this rank's shard) holds a NaN or an
    infinity, NONE when none does, without a wait for the device: taken before clipping, which spreads one NaN to
    every gradient."""
    indices = [i for i, param in enumerate(parameters) if param.grad is not None]
    return first_nonfinite([local(parameters[i].grad).detach() for i in indices], [codes[i] for i in indices])


def reduced_checks(strategy, losses: list[torch.Tensor], gradient: torch.Tensor, grad_norm) -> tuple[int, int, bool]:
    """(the least `loss_code`, the least `gradient_code`, whether the gradient norm is finite) over every rank: one
    collective of three numbers, so that every rank takes the same decision."""
    finite = torch.isfinite(torch.as_tensor(grad_norm, device=strategy.device)).long().reshape(())
    code = loss_code(losses, strategy.rank, strategy.world_size).to(strategy.device)
    loss, first_gradient, norm_finite = strategy.all_min(torch.stack([code, gradient.to(strategy.device), finite]))
    return int(loss), int(first_gradient), bool(norm_finite)


def loss_code(losses: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """`micro * world_size + rank` of this rank's first micro-batch whose loss is non-finite (NONE: none), so that
    the minimum over the ranks names the earliest micro-batch and its rank."""
    if not losses:
        return torch.tensor(NONE)
    bad = ~torch.isfinite(torch.stack([loss.detach().float().reshape(()) for loss in losses]))
    codes = torch.arange(len(losses), device=bad.device) * world_size + rank
    return torch.where(bad, codes, torch.full_like(codes, NONE)).min()


@dataclass(frozen=True)
class Fault:
    """What went non-finite in an optimizer step: `quantity` ("loss", "gradient norm", "parameter") and where."""

    quantity: str
    where: str

    def __str__(self) -> str:
        return f"the {self.quantity} is non-finite ({self.where})"


def step_fault(loss: int, norm_finite: bool, world_size: int, grad_owner: str | None = None) -> Fault | None:
    """The skip decision of one optimizer step, from values every rank holds alike (reduced over the ranks): `loss`,
    the least `loss_code`; `norm_finite`, whether the global gradient norm is finite; `grad_owner`, the parameter of
    the first non-finite gradient (None: every gradient is finite). The loss comes first: a non-finite loss makes
    the gradients non-finite too."""
    if loss < NONE:
        micro, rank = divmod(loss, world_size)
        return Fault("loss", f"micro-batch {micro}" + (f" of rank {rank}" if world_size > 1 else ""))
    if not norm_finite:
        where = f"the first non-finite gradient: {grad_owner}" if grad_owner else "every gradient is finite"
        return Fault("gradient norm", where)
    return None


@dataclass
class NonfiniteSteps:
    """The optimizer steps of one backend: `attempted`, `skipped` (non-finite, cumulative), `in_a_row` (skipped
    since the last finite one); at the `limit`-th in a row the run stops."""

    limit: int
    attempted: int = 0
    skipped: int = 0
    in_a_row: int = 0

    def begin(self, step: int | None) -> int:
        """Count an attempted optimizer step; the number its messages and the fault hook use: the loop's `step`, or
        this backend's count of optimizer steps when the caller gives none."""
        self.attempted += 1
        return self.attempted if step is None else step

    def finite(self) -> None:
        self.in_a_row = 0

    def skip(self, step: int, fault: Fault, what: str = "training") -> str:
        """Count a skipped step; the line that says so, or a `NumericalError` at the limit."""
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise NumericalError(
                f"{what} stopped at step {step}: {fault}; non-finite optimizer steps in a row: {self.in_a_row}, the "
                f"limit (training.max_nonfinite_steps); lower optimizer.lr or look at that step's data; a run started "
                "again resumes from its last finite checkpoint"
            )
        return f"step {step}: {fault}; the optimizer step was skipped ({self.in_a_row} in a row, {self.skipped} in all)"

    def save(self, path: Path) -> None:
        """numerics.json beside a checkpoint's trainer state: the counters and the `finite` mark."""
        (path / NUMERICS_FILE).write_text(json.dumps({**asdict(self), "finite": self.in_a_row == 0}) + "\n")

    def load(self, path: Path) -> None:
        """The counters of a checkpoint (none in one written before they were: all 0); `limit` stays this run's."""
        file = path / NUMERICS_FILE
        saved = json.loads(file.read_text()) if file.is_file() else {}
        for name in ("attempted", "skipped", "in_a_row"):
            setattr(self, name, int(saved.get(name, 0)))


def parameter_error(step: int, name: str, what: str = "training") -> NumericalError:
    """The run stops: an optimizer step from a finite gradient left a parameter non-finite (it cannot be undone)."""
    return NumericalError(
        f"{what} stopped at step {step}: the parameter {name} is non-finite (or so large that its square "
        "overflows) after the optimizer step, from a finite gradient: the update overflowed; lower "
        "optimizer.lr; nothing of this step was saved, and a run started again resumes from its last finite "
        "checkpoint"
    )


def state_error(name: str, what: str) -> NumericalError:
    """A state about to be written (a checkpoint, the final model) holds a non-finite value: it is not written."""
    return NumericalError(
        f"{what} not written: {name} holds a non-finite value (or a weight so large that its square overflows)"
    )
