"""A trainer's state on disk, in one format for every layout: what `Backend.save_state` writes and `load_state` reads.

The state directory is a torch.distributed.checkpoint (DCP) of the model's state dict and AdamW's, both keyed by
parameter name (`model.layers.0.mlp.up_proj.weight`, as `get_state_dict` gives them for a plain model in one
process and for a sharded model of DTensors on N ranks; AdamW's hyperparameters too, per name, so that pipeline
stages, each with the optimizer of its own layers, write disjoint entries), and `scheduler.pt`, the LR schedule's
position. A pipeline stage's copy of a tied embedding (the last stage's LM head) is saved under its own model name
and its AdamW state under the embedding's, as one process keys the one tensor of both. DCP
stores each tensor under its global shape, each writer's pieces at their offsets (one process writes one file,
`__0_0.distcp`; N ranks one each), and a reader loads the pieces its own shards cover. So a checkpoint resumes
under any layout: written on 2 FSDP2 ranks, read in one process or on ranks of another mesh, and back
(tests/unit/test_reshard.py: the next step's loss, grad_norm and weights equal the uninterrupted run's to 1e-5;
expert-parallel ranks' experts, DTensors on their own mesh, are stored whole the same way:
tests/unit/test_expert_parallel.py; pipeline stages each write their own layers: test_pipeline_checkpoint.py),
and `reinforge convert` reads the global tensors of any (`model_state_dict`).

With LoRA (`adapter_only`) the state is the adapter's and its AdamW state's only: the frozen base is the model's
own files. A checkpoint written before this format, one `state.pt` (weights, AdamW state keyed by parameter
index, schedule), still loads in one process. Every file loads without running code (training/safe_load.py).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from reinforge.errors import ConfigError
from reinforge.training.lora import is_adapter_key, load_adapter_state_dict
from reinforge.training.parallel.pipeline_weights import tied_copies
from reinforge.training.safe_load import check_dcp_metadata, dcp_load, load_pickled

LEGACY_FILE, SCHEDULER_FILE = "state.pt", "scheduler.pt"
NESTED_MARK = "optimizer.param_groups.0.params"  # a checkpoint from before the flat AdamW format (`_state`)


@contextmanager
def _quiet(distributed: bool):
    """DCP warns that it "assumes the intent" of one process whenever it runs without a process group: it is ours."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent")
        yield


def _state(model, optimizer, adapter_only: bool, flat: bool = True) -> tuple[dict, StateDictOptions]:
    """The model's and AdamW's state dicts by parameter name (sharded on ranks), for DCP; with LoRA the adapter's
    only (`ignore_frozen_params` alone would keep the frozen embedding under its tied second name, lm_head).
    `flat`: AdamW's hyperparameters per parameter name too (`param_groups.NAME.lr`), so that pipeline stages, each
    with the optimizer of its own parameters, write no shared entry; False: the format before pipelines (one
    `param_groups.0` list of names), which checkpoints written then hold."""
    # checkpoints skip the frozen base (the model's files hold it); load_state then fills only the adapter
    options = StateDictOptions(
        ignore_frozen_params=adapter_only, strict=not adapter_only, flatten_optimizer_state_dict=flat
    )
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if adapter_only:
        model_state = {name: tensor for name, tensor in model_state.items() if is_adapter_key(name)}
    return {"model": model_state, "optimizer": _renamed(optimizer_state, tied_copies(model))}, options


def _renamed(optimizer_state: dict, names: dict[str, str]) -> dict:
    """AdamW's state dict (either format) with the parameters of `names` under their new names: a pipeline stage's
    copy of a tied embedding keyed by the embedding's name, as one process keys its one tensor."""
    if not names:
        return optimizer_state
    if "state" in optimizer_state:  # the format of one param_groups list
        return {
            "state": {names.get(name, name): value for name, value in optimizer_state["state"].items()},
            "param_groups": [
                {**group, "params": [names.get(name, name) for name in group["params"]]}
                for group in optimizer_state["param_groups"]
            ],
        }
    renamed = {}
    for key, value in optimizer_state.items():
        kind, _, rest = key.partition(".")  # state.NAME.exp_avg, param_groups.NAME.lr
        name = next((n for n in names if rest.startswith(f"{n}.")), None)
        renamed[key if name is None else f"{kind}.{names[name]}{rest[len(name) :]}"] = value
    return renamed


def save_state(
    model, optimizer, scheduler, path: Path, adapter_only: bool, is_main: bool, distributed: bool = False
) -> None:
    """Write the state to the directory `path`. `distributed`: every rank of the process group calls this (a
    collective) and writes its own shards (on several nodes `path` must be on a shared filesystem); `is_main`
    writes the schedule."""
    path.mkdir(parents=True, exist_ok=True)
    with _quiet(distributed):
        dcp.save(_state(model, optimizer, adapter_only)[0], checkpoint_id=str(path), no_dist=not distributed)
    if is_main:
        torch.save(scheduler.state_dict(), path / SCHEDULER_FILE)
    if distributed:
        dist.barrier()


def load_state(model, optimizer, scheduler, path: Path, adapter_only: bool, distributed: bool = False) -> None:
    """Restore what `save_state` wrote under any layout (or a one-process `state.pt`) into this model and
    optimizer, as they are placed here."""
    if (path / LEGACY_FILE).is_file():
        if distributed:
            raise ConfigError(
                f"{path} holds a one-process checkpoint in the format before checkpoints resharded ({LEGACY_FILE}); "
                "resume it with training.backend=torch, whose next checkpoint any layout reads"
            )
        return _load_legacy(model, optimizer, scheduler, path, adapter_only)
    check_dcp_metadata(path)
    flat = NESTED_MARK not in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state, options = _state(model, optimizer, adapter_only, flat)
    with _quiet(distributed):  # a checkpoint from elsewhere runs no code (training/safe_load.py)
        dcp_load(state, path, distributed)
    back = {source: name for name, source in tied_copies(model).items()}
    optimizer_state = _renamed(state["optimizer"], back)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optimizer_state, options=options)
    scheduler.load_state_dict(load_pickled(path / SCHEDULER_FILE))


def _load_legacy(model, optimizer, scheduler, path: Path, adapter_only: bool) -> None:
    state = load_pickled(path / LEGACY_FILE)
    if adapter_only:
        load_adapter_state_dict(model, state["model"])
    else:
        model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


def model_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The model's whole tensors in a state directory written under any layout (or a `state.pt`), in one process,
    without its AdamW state (only what DCP's metadata lists under `model.` is read)."""
    if (path / LEGACY_FILE).is_file():
        return load_pickled(path / LEGACY_FILE)["model"]
    check_dcp_metadata(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    state = {"model": model}
    with _quiet(distributed=False):
        dcp_load(state, path, distributed=False)
    return state["model"]
