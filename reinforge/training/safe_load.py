"""Files from elsewhere, read without running their code: checkpoints (`driver.pt`, `scheduler.pt`, a
`state.pt`, a torch.distributed.checkpoint directory) and what `reinforge convert` reads.

A pickle can name any function to call while it loads (`os.system` among them), so a checkpoint copied from
another machine or downloaded is code. Everything here loads with `torch.load(weights_only=True)`, which builds
tensors, containers and plain values only; beyond those it allows reinforge's own plain data classes (the
dataclasses and enums a driver state holds, such as in-flight rollouts), built without running any of their
methods, numpy arrays and images (an MoE trajectory's routes, a vision-language prompt's images). A DCP
directory's `.metadata` (which DCP reads with plain `pickle.load`) is first read by an unpickler that knows DCP's
metadata classes only, and its non-tensor entries load with `weights_only=True` too (`SafeLoadPlanner`; DCP's
own planner loads them with `weights_only=False`). A file that needs more is a one-line error naming the file
and what it asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals

from reinforge.errors import DataError

# what a DCP directory's .metadata may name: its own classes, torch's sizes, dtypes and layouts, a path
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.",)
_DCP_METADATA_NAMES = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size")}
_DCP_METADATA_NAMES |= {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def refused(path: Path | str, what: str) -> DataError:
    return DataError(
        f"{path} needs {what} to load, which a reinforge checkpoint never holds (a pickle that can run code); "
        "load only files you trust, written by reinforge"
    )


# plain values a driver state may hold besides tensors: numpy arrays (an MoE trajectory's routes), images
_PLAIN_VALUES = {"numpy.ndarray", "numpy.dtype", "PIL.Image.Image"}
_PLAIN_VALUES |= {"numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct"}


def _allowed(name: str) -> Any:
    """What `name` (module.attribute) is, when a checkpoint may name it: reinforge's own dataclasses and enums, the
    plain values above, numpy's dtype classes; else None."""
    module, _, attr = name.rpartition(".")
    if not (module.startswith("reinforge.") or name in _PLAIN_VALUES or module == "numpy.dtypes"):
        return None
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None
    if not module.startswith("reinforge."):
        return found
    plain = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
    return found if plain else None


def load_pickled(path: Path | str) -> Any:
    """`torch.load(path, weights_only=True)`, reinforge's plain data classes allowed; anything else is refused."""
    allowed = []
    try:
        needed = get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, ValueError):  # not torch's zip format (torch.load's own checks then answer)
        needed = []
    for name in needed:
        found = _allowed(name)
        if found is None:
            raise refused(path, name)
        allowed.append(found)
        if name.startswith("numpy."):  # an array's dtype is built from its class (numpy.dtypes.UInt8DType...)
            dtypes = importlib.import_module("numpy.dtypes")
            allowed += [getattr(dtypes, kind) for kind in dtypes.__all__]
    with safe_globals(allowed):
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refused(path, _first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    """What torch's weights_only unpickler refused (`posix.system`), from its many-line message."""
    found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(exc))
    return (found.group(1) or found.group(2)) if found else "more than tensors and plain values"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_METADATA_MODULES) or (module, name) in _DCP_METADATA_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_dcp_metadata(directory: Path) -> None:
    """Refuse a DCP directory whose `.metadata` names anything but DCP's metadata classes (before DCP unpickles it)."""
    path = Path(directory) / ".metadata"
    if not path.is_file():
        return  # DCP's own error names what is missing
    try:
        _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as exc:
        raise refused(path, str(exc)) from None


def dcp_load(state: dict, path: Path, distributed: bool) -> None:
    """`dcp.load(state, path)` without running code from the checkpoint: its .metadata checked first, its
    non-tensor entries loaded by `SafeLoadPlanner`; a refusal is one line (DCP would wrap it in its own)."""
    import torch.distributed.checkpoint as dcp

    check_dcp_metadata(path)
    refusals: list[DataError] = []
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not distributed, planner=SafeLoadPlanner(path, refusals))
    except BaseException:  # DCP's CheckpointException is one
        if refusals:
            raise refusals[0] from None
        raise


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries (an optimizer's step, learning rates) with
    `weights_only=True` (DefaultLoadPlanner.load_bytes, with that one change)."""

    def __init__(self, path: Path | str, refusals: list[DataError]):
        super().__init__()
        self.path = path
        self.refusals = refusals  # what it refused (DCP raises its own CheckpointException around it)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            self.refusals.append(refused(f"{self.path}'s entry {fqn}", _first_line(exc)))
            raise self.refusals[-1] from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
