"""Refit verification: does the engine serve the weights just sent? (`generation.verify_refit_every`)

Each engine worker reports a sha256 digest of every weight where it holds it, in its own names and layout
(`WeightDigests`): the HF engine of its state_dict; vLLM of each parameter of its model, with the weights
of its CPU linear layers read back through the layer's own GEMM kernel (vLLM-CPU repacks them into
oneDNN's layout after loading and frees the parameter, so the parameter says nothing there; vllm_digests.py).
A digest covers every row and a deterministic sample of the last dimension's columns (`column_sample`, about
`generation.verify_refit_columns` of them, evenly spaced, their offset rotating with the step so successive refits
cover every column); a weight no wider than that is hashed whole. Equal digests are equal bytes of what they cover:
the check is exact, never a tolerance.

The expected digests come from the very tensors the refit sent, mapped into each worker's layout
(weight_sources.py), group by group as the refit sends them (`Expectation`: one decoder layer at a time, keeping
only digests), from the engine's layout without its digests (`weight_layout()`, fetched once). vLLM's names come
from the sent weights in the checkpoint's layout (checkpoint_layout.py), renamed by its model's own mapping.
`verify` is the check of a whole dict at once (in-process engines). For a LoRA adapter sync the engine reports the
digests of the adapter tensors it loaded and serves (none when no adapter is loaded), and the expected ones are
those of the adapter file the trainer wrote.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from reinforge.errors import ReinforgeError
from reinforge.generation.checkpoint_layout import checkpoint_layout, engine_tensors
from reinforge.generation.weight_sources import EXPERT_WEIGHT, engine_tensor, expert_source, fused_parts


class RefitMismatch(ReinforgeError):
    """An engine does not serve the weights (or the adapter) the refit just sent."""


@dataclass
class WeightDigests:
    """What one engine serves: a digest, shape and dtype per weight, in the engine's names (its layout alone:
    digests empty)."""

    engine: str  # e.g. "vllm engine", "generation[1]"
    digests: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # "float32", "bfloat16", ...
    packed_modules: dict[str, list[str]] = field(default_factory=dict)  # fused name -> its parts, in order
    tp_rank: int = 0  # an engine of several tensor-parallel workers: this worker's shards
    tp_size: int = 1
    expert_prepack_isa: str | None = None  # vLLM-CPU: the ISA its MoE expert weights are prepacked for
    # An engine loading checkpoints (vLLM): the model whose checkpoint layout the refit sent (checkpoint_layout.py),
    # the names its model definition renames, and its fused-MoE weights' experts by checkpoint name.
    checkpoint_model: str | None = None
    renames: dict[str, str] = field(default_factory=dict)
    expert_names: dict[str, dict] = field(default_factory=dict)
    columns: int = 0  # the digests' column sample (`column_sample`): 0 whole
    step: int = 0


def tp_worker(engine: WeightDigests) -> str:
    """How an error names one of an engine's several tensor-parallel workers."""
    return f"(tensor-parallel worker {engine.tp_rank} of {engine.tp_size})"


def column_sample(shape: tuple[int, ...], columns: int, step: int) -> slice | None:
    """The columns of the last dimension a digest of a weight of `shape` covers: every `stride`-th from `step` mod
    `stride`, `stride` = ceil(width / `columns`) (at most `columns` of them; successive steps cover every column);
    None (all of it) when `columns` is 0, the weight a scalar, or no wider than `columns`."""
    if columns <= 0 or not shape or shape[-1] <= columns:
        return None
    stride = -(-shape[-1] // columns)
    return slice(step % stride, None, stride)


def sampled(tensor: torch.Tensor, columns: int, step: int) -> torch.Tensor:
    """`tensor`'s sampled columns (`column_sample`), all of it when none are sampled."""
    sample = column_sample(tuple(tensor.shape), columns, step)
    return tensor if sample is None else tensor[..., sample]


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes; -0.0 counts as 0.0 (a read-back through a GEMM cannot tell them apart)."""
    tensor = tensor.detach().cpu()  # first: the copy below never takes accelerator memory
    if tensor.is_floating_point():
        tensor = tensor + 0
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def digest_all(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`tensor_digest` of each tensor, hashed on all cores (hashlib releases the GIL)."""
    named = list(named_tensors)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip([name for name, _ in named], pool.map(tensor_digest, [t for _, t in named])))


def report(
    engine: str, named_tensors: Iterable[tuple[str, torch.Tensor]], packed=None, tp_rank: int = 0, tp_size: int = 1,
    expert_prepack_isa: str | None = None, columns: int = 0, step: int = 0,
    presampled: dict[str, tuple[int, ...]] | None = None, digests: bool = True,
) -> WeightDigests:  # fmt: skip
    """An engine's (or one of its tensor-parallel workers') `WeightDigests` of the tensors it serves, each of its
    sampled columns (`columns`, `step`); `presampled`: the whole shapes of tensors given already sampled (read back
    that way); `digests` False: the layout alone."""
    presampled = presampled or {}
    named = [(name, tensor.detach()) for name, tensor in named_tensors]
    covered = [(n, t if n in presampled else sampled(t, columns, step)) for n, t in named] if digests else []
    return WeightDigests(
        engine=engine,
        digests=digest_all(covered),
        shapes={name: presampled.get(name, tuple(t.shape)) for name, t in named},
        dtypes={name: str(t.dtype).removeprefix("torch.") for name, t in named},
        packed_modules=dict(packed or {}),
        tp_rank=tp_rank,
        tp_size=tp_size,
        expert_prepack_isa=expert_prepack_isa,
        columns=columns,
        step=step if columns else 0,  # whole weights: the same at every step
    )


def expected_digests(
    engine: WeightDigests, sent: Mapping[str, torch.Tensor], what: str, columns: int = 0, step: int = 0,
    names: Iterable[str] | None = None,
) -> dict[str, str]:  # fmt: skip
    """The digests `engine` must report of its weights `names` (all of them by default), each built from the sent
    tensors in its layout (weight_sources.py), its sampled columns only, hashed on all cores (each task builds its
    own tensor, so at most one per core is alive at a time)."""

    def expected(name: str) -> str:
        shape = engine.shapes[name]
        tensor = engine_tensor(
            name, sent, shape, engine.dtypes[name], engine.packed_modules, engine.tp_rank, engine.tp_size,
            engine.expert_prepack_isa, column_sample(shape, columns, step),
        )  # fmt: skip
        if tensor is None:
            raise no_counterpart(engine, name, what)
        return tensor_digest(tensor)

    names = list(engine.shapes if names is None else names)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(expected, names)))


def no_counterpart(engine: WeightDigests, name: str, what: str) -> RefitMismatch:
    return RefitMismatch(
        f"refit check: cannot verify {engine.engine}: its {name} {list(engine.shapes[name])} has no "
        f"counterpart among the {what} sent; set generation.verify_refit_every=0 to run unverified"
    )


def origin(name: str, engine: WeightDigests, sent: Mapping[str, torch.Tensor]) -> str:
    """Where an engine weight comes from, when not from the sent tensor of its name, for an error message."""
    if name in sent:
        return ""
    expert = EXPERT_WEIGHT.match(name)
    if expert:
        return f" (from {'gate_up_proj' if expert['kind'] == 'w13' else 'down_proj'})"
    return f" (fused from {', '.join(engine.packed_modules.get(name.rpartition('.')[0].rpartition('.')[2], []))})"


def source_names(name: str, engine: WeightDigests) -> list[str]:
    """The sent names engine weight `name` could be built from: its own, a fused weight's first part, the experts'."""
    parts = fused_parts(name, engine.packed_modules)
    expert = expert_source(name)
    return [name, *parts[:1], *([expert] if expert else [])]


def layout_key(engine: WeightDigests) -> tuple:
    """What makes two engines' expected digests equal: the engines of a group share one layout (per worker)."""
    return (
        tuple(engine.shapes.items()), tuple(engine.dtypes.items()), engine.tp_rank, engine.tp_size,
        engine.expert_prepack_isa, engine.checkpoint_model,
    )  # fmt: skip


class Expectation:
    """The digests each engine worker must report, computed group by group as the refit sends its weights (`add`,
    once per decoder layer, or for what lies outside the layers, in the checkpoint's layout for an engine that
    loads checkpoints), keeping only digests: no process needs the whole model. `layouts`: each engine worker's
    `WeightDigests` (digests empty: `weight_layout()`); `columns`, `step`: the sample (`column_sample`)."""

    def __init__(self, layouts: list[WeightDigests], columns: int = 0, step: int = 0, what: str = "weights"):
        self.columns, self.step, self.what = columns, step if columns else 0, what
        self.failure: RefitMismatch | None = None  # a weight whose sources came but do not fit its layout
        self.layouts: dict[tuple, WeightDigests] = {}  # the first engine of each layout names it in errors
        for layout in layouts:
            self.layouts.setdefault(layout_key(layout), layout)
        self.expected: dict[tuple, dict[str, str]] = {key: {} for key in self.layouts}
        self.origins: dict[tuple, dict[str, str]] = {key: {} for key in self.layouts}
        self.wanted: dict[tuple, dict[str, list[str]]] = {}  # by layout: sent name -> engine weights it may build
        for key, layout in self.layouts.items():
            wanted = self.wanted[key] = {}
            for name in layout.shapes:
                for source in source_names(name, layout):
                    wanted.setdefault(source, []).append(name)

    def add(self, group: Mapping[str, torch.Tensor]) -> None:
        """The digests of every engine weight whose sources are in `group` (one decoder layer's tensors, or those
        outside the layers; every engine weight's sources lie in one group)."""
        renamed: dict[tuple, Mapping[str, torch.Tensor]] = {}  # the engine's names, per distinct mapping
        for key, layout in self.layouts.items():
            mapping = (layout.checkpoint_model, tuple(layout.renames.items()), repr(layout.expert_names))
            if mapping not in renamed:
                renamed[mapping] = (
                    group if layout.checkpoint_model is None
                    else engine_tensors(dict(group), layout.renames, layout.expert_names)
                )  # fmt: skip
            sent, done = renamed[mapping], self.expected[key]
            names = {n for source in sent for n in self.wanted[key].get(source, []) if n not in done}
            names = [name for name in layout.shapes if name in names and buildable(name, layout, sent)]
            try:
                done.update(expected_digests(layout, sent, self.what, self.columns, self.step, names))
            except RefitMismatch as error:  # said by `digests`: the refit's sending goes on undisturbed
                self.failure = self.failure or error
            self.origins[key].update((name, origin(name, layout, sent)) for name in names)

    def digests(self) -> dict[tuple, dict[str, str]]:
        """The expected {name: digest} of each distinct layout (`layout_key`); a `RefitMismatch` for an engine
        weight no group provided."""
        if self.failure is not None:
            raise self.failure
        for key, layout in self.layouts.items():
            for name in layout.shapes:
                if name not in self.expected[key]:
                    raise no_counterpart(layout, name, self.what)
        return self.expected


def buildable(name: str, engine: WeightDigests, sent: Mapping[str, torch.Tensor]) -> bool:
    """Whether every sent tensor engine weight `name` is made of is in `sent` (its own, its fused parts or its
    experts): a fused weight whose parts a group has only some of waits for none, and says "no counterpart"."""
    if name in sent:
        return True
    parts = fused_parts(name, engine.packed_modules)
    return (bool(parts) and all(part in sent for part in parts)) or expert_source(name) in sent


def check(reports: list[WeightDigests], expectation: Expectation) -> None:
    """Raise `RefitMismatch` naming the first engine (and tensor-parallel worker) and weight whose digest differs
    from the expected one, or an engine that serves nothing."""
    what = expectation.what
    expected = None
    for engine in reports:
        if not engine.digests:
            raise RefitMismatch(f"refit check: {engine.engine} serves no {what}: it was never loaded")
        if (engine.columns, engine.step) != (expectation.columns, expectation.step):
            raise ValueError(
                f"{engine.engine} digested columns={engine.columns} step={engine.step}, the check expects "
                f"columns={expectation.columns} step={expectation.step}"
            )
        expected = expected or expectation.digests()
        key = layout_key(engine)
        if key not in expected:
            name = next(iter(engine.shapes))
            raise no_counterpart(engine, name, what)
        for name, digest in engine.digests.items():
            if digest != expected[key].get(name):
                raise RefitMismatch(
                    f"refit check: {engine.engine} does not serve the {what} just sent: "
                    f"{name}{expectation.origins[key].get(name, '')} differs (stale or wrongly loaded); the run stops "
                    "rather than train off-policy"
                )


def as_sent_to(engine: WeightDigests, sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's tensors `sent` as the refit hands them to `engine`: in the checkpoint's layout for an engine
    that loads checkpoints (checkpoint_layout.py); `Expectation.add` renames them as its model does."""
    if engine.checkpoint_model is None:
        return sent
    return checkpoint_layout(engine.checkpoint_model, sent.items())


def verify(
    reports: list[WeightDigests], sent: dict[str, torch.Tensor], what: str = "weights", columns: int = 0,
    step: int = 0,
) -> None:  # fmt: skip
    """Raise `RefitMismatch` naming the first engine and weight whose digest differs from the sent tensor's: the
    whole of `sent` (the trainer's in-memory layout) as one group of an `Expectation` of the reports' layouts."""
    by_model: dict[str | None, list[WeightDigests]] = {}
    for engine in reports:
        by_model.setdefault(engine.checkpoint_model, []).append(engine)
    for engines in by_model.values():
        expectation = Expectation(engines, columns, step, what)
        expectation.add(as_sent_to(engines[0], sent))
        check(engines, expectation)


def adapter_tensors(path: str | Path, dtype: str) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors as an engine computes with them: in `dtype`, under vLLM's names
    (`MODULE.lora_a` / `MODULE.lora_b`, MODULE without PEFT's `base_model.model.` prefix), B times the LoRA
    scaling (alpha / r, alpha / sqrt(r) with rsLoRA), which vLLM folds into B after casting it."""
    import json
    import math

    from safetensors.torch import load_file

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    renamed = {}
    for name, tensor in load_file(str(Path(path) / "adapter_model.safetensors")).items():
        module, _, kind = name.removeprefix("base_model.model.").removesuffix(".weight").rpartition(".")
        tensor = tensor.to(getattr(torch, dtype))
        if kind == "lora_B" and scaling != 1:
            tensor = tensor * scaling
        renamed[f"{module}.{kind.replace('lora_A', 'lora_a').replace('lora_B', 'lora_b')}"] = tensor
    return renamed
