"""LoRA adapters under tensor parallelism (`model.lora` with `training.parallel.tp`): each split with its base layer.

PEFT's LoRA layer computes base(x) + (alpha / r) B(A(dropout(x))). Every adapted projection of a decoder layer
is planned by the layer's tensor-parallel plan (parallel/tensor_plan.py) as if it were the plain linear;
`adapter_styles` turns its style into three, the base's own and one for each adapter matrix, so that B(A(x)) has
exactly the base's output layout (PEFT's own Megatron layer, `LoraParallelLinear`, splits them the same way):

- a column-wise base (q/k/v, gate/up: weight [out, in] split on out): A [r, in] replicated, B [out, r] split on
  out like the base, so each rank computes its columns of B A x from the whole [.., r] activations; their
  gradient (B's input) is all-reduced over the ranks, as the base's input gradient is, so A's gradient is whole
  on every rank;
- a row-wise base (o, down: weight split on in): A [r, in] split on in, its partial [.., r] products
  reduce-scattered over the sequence (or all-reduced) exactly as the base's partial outputs are, then B [out, r]
  replicated, applied to this rank's positions, its gradient summed over the ranks (a `Partial` DTensor's).

The only new communication is of [.., r] activations. Every adapter matrix stays a parameter under one process's
name, a DTensor whose `full_tensor()` is one process's matrix: the merged refit weights, the PEFT export and the
checkpoints (DCP, which reshards between layouts) see whole adapters. LoRA's dropout is refused under tp
(`check_lora_dropout`): the ranks of a row-wise layer would draw their masks on their own columns of one input.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from reinforge.errors import ConfigError

ADAPTER = "default"  # PEFT's name for the one adapter (training/lora.py)


def check_lora_dropout(tp: int, dropout: float) -> None:
    if tp > 1 and dropout > 0:
        raise ConfigError(
            f"model.lora.dropout={dropout} with training.parallel.tp={tp}: the tensor-parallel ranks would draw "
            "different dropout masks for their parts of one input, which one process never does; set "
            "model.lora.dropout=0 (or training.parallel.tp=1)"
        )


def is_adapted(module: torch.nn.Module) -> bool:
    """A PEFT LoRA layer around a linear (its `base_layer`)."""
    return isinstance(getattr(module, "base_layer", None), torch.nn.Linear) and hasattr(module, "lora_A")


class Replicated(ParallelStyle):
    """The module's parameters replicated over the mesh (a DTensor each) and its forward on DTensors: the input,
    a local tensor laid out as `input_layout`, and the output, handed back as a local tensor laid out as
    `output_layout`. On an input split over the sequence the weight's gradient is a partial sum, summed over
    the ranks (torchtitan's NoParallel)."""

    def __init__(self, input_layout: Placement, output_layout: Placement):
        super().__init__()
        self.input_layout, self.output_layout = input_layout, output_layout

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return distribute_module(
            module,
            device_mesh,
            None,  # every parameter replicated, its requires_grad kept
            partial(self._input, self.input_layout),
            partial(self._output, self.output_layout),
        )

    @staticmethod
    def _input(layout, module, inputs, device_mesh):
        return (DTensor.from_local(inputs[0], device_mesh, (layout,), run_check=False), *inputs[1:])

    @staticmethod
    def _output(layout, module, output, device_mesh):
        return output.redistribute(placements=(layout,)).to_local()


def adapter_styles(layer: torch.nn.Module, plan: dict, tp: int) -> dict:
    """`plan` (module name -> style) with each adapted projection's style replaced by its base's and its adapter
    matrices' (module docstring), for `tp` ranks."""
    adapted = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not is_adapted(module):
            adapted[name] = style
            continue
        check_lora_dropout(tp, getattr(module.lora_dropout[ADAPTER], "p", 0.0))  # Identity when 0
        a, b = f"{name}.lora_A.{ADAPTER}", f"{name}.lora_B.{ADAPTER}"
        if isinstance(style, ColwiseParallel):
            (inputs,), (outputs,) = style.input_layouts, style.output_layouts
            adapted[a] = Replicated(inputs, Replicate())
            adapted[b] = ColwiseParallel(output_layouts=outputs, use_local_output=style.use_local_output)
        elif isinstance(style, RowwiseParallel):
            (inputs,), (outputs,) = style.input_layouts, style.output_layouts
            adapted[a] = RowwiseParallel(input_layouts=inputs, output_layouts=outputs)
            adapted[b] = Replicated(outputs, outputs)
        else:
            raise ConfigError(f"tensor parallelism does not know how to split the LoRA adapter of {name}")
        adapted[f"{name}.base_layer"] = style
    return adapted
