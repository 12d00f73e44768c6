"""Whole weights of a pipeline-parallel model (`training.parallel.pp` > 1): refit, export and `named_weights`.

Each stage holds its own decoder layers (parallel/pipeline.py's `split_stage`) under one process's names, sharded
over the stage's own data- and tensor-parallel ranks. `full_state_dict` gives every rank the tensors it is asked
for whole, on the CPU, as one process would: each name's owner (the lowest stage that holds it) gathers it from
its shards (`DTensor.full_tensor` over the stage's own mesh), then broadcasts it over the pipeline group (a rank
and its peers at the same place of the other stages). The shapes and dtypes the other stages receive into are
the stages' state-dict metadata, exchanged once per model (`FullLayout`). A refit asks for one decoder layer at a
time (`Backend.weight_parts`), so no process holds more than one layer whole beside its own shards.

Tied embeddings: one process binds `lm_head.weight` to `model.embed_tokens.weight`; at pp > 1 the first stage
holds the embedding and the last its own copy of it as the LM head (the two take the same steps). The tied name is
given the embedding's gathered tensor, one object under both names as one process gives it, and checkpoints key
the copy's AdamW state by the embedding's name (`tied_copies`, training/state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class FullLayout:
    """One process's state dict of the model, as its stages together hold it."""

    names: list[str]
    """Every stage's state-dict names, stage by stage (one process's order: embedding, layers, norm, LM head)."""
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    owners: dict[str, int]
    """The lowest stage holding each name: the one that gathers and broadcasts it."""
    tied: dict[str, str]
    """{tied name: the name whose tensor one process binds it to} (an LM head tied to the embedding)."""


def full_layout(model: torch.nn.Module, group) -> FullLayout:
    """The stages' state-dict metadata, exchanged over the pipeline group (a collective of its ranks)."""
    mine = [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()]
    stages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, mine, group=group)
    names, shapes, dtypes, owners = [], {}, {}, {}
    for stage, entries in enumerate(stages):
        for name, shape, dtype in entries:
            if name not in owners:
                names.append(name)
                shapes[name], dtypes[name], owners[name] = shape, dtype, stage
    tied = {name: source for name, source in tied_weights(model).items() if name in owners and source in owners}
    return FullLayout(names, shapes, dtypes, owners, tied)


def tied_weights(model: torch.nn.Module) -> dict[str, str]:
    """transformers' {tied name: source name} of the model (empty when its embeddings are not tied)."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def tied_copies(model: torch.nn.Module) -> dict[str, str]:
    """{name: one process's name of its tensor} for the tied parameters this model holds apart from their source:
    the last pipeline stage's LM head, tied to an embedding only the first stage holds. Empty in one process."""
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: source for name, source in tied_weights(model).items() if name in held and source not in held}


@torch.no_grad()
def full_state_dict(
    model: torch.nn.Module,
    names: list[str] | None,
    layout: FullLayout,
    group,
    stage: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The tensors of `names` (all by default) whole, fp32 as the master weights are, on the CPU of every rank (a
    collective of all ranks: each name's owner stage gathers it over its mesh and broadcasts it over `group`);
    a tied name is bound to its source's tensor."""
    wanted = layout.names if names is None else names
    sources = {layout.tied.get(name, name) for name in wanted}
    local = model.state_dict(keep_vars=True)
    gathered: dict[str, torch.Tensor] = {}
    for name in (name for name in layout.names if name in sources):  # one order on every rank
        owner = layout.owners[name]
        if stage == owner:
            tensor = local[name].full_tensor() if isinstance(local[name], DTensor) else local[name]
            # a copy: a stage of one rank's full tensor is its parameter itself, which the next steps change
            tensor = tensor.detach().to(device, layout.dtypes[name], memory_format=torch.contiguous_format, copy=True)
        else:
            tensor = torch.empty(layout.shapes[name], dtype=layout.dtypes[name], device=device)
        dist.broadcast(tensor, group=group, group_src=owner)
        gathered[name] = tensor.cpu()
    return {name: gathered[layout.tied.get(name, name)] for name in wanted}


def save_adapter(peft, adapter: dict[str, torch.Tensor], path: Path) -> None:
    """PEFT's directory of the whole LoRA adapter (`adapter`: every stage's tensors by the Hugging Face model's
    names), written by the main rank, whose model holds the LoRA layers of its own stage only: PEFT keeps only the
    entries of layers it holds, so it writes the config and its weights file is then rewritten with every
    stage's entries, under PEFT's names (`base_model.model.` before, the adapter's name taken out)."""
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    peft.save_pretrained(path, state_dict={f"base_model.model.{name}": tensor for name, tensor in adapter.items()})
    segment = f".{peft.active_adapter}."
    tensors = {
        f"base_model.model.{name.replace(segment, '.')}": tensor.contiguous() for name, tensor in adapter.items()
    }
    save_file(tensors, str(path / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
