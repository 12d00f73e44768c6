"""The trainer's weights as the model's checkpoint on disk holds them, for an engine that loads checkpoints (vLLM).

transformers 5 loads some checkpoints into another layout than the one on disk (its conversion mapping,
transformers/conversion_mapping.py): a mixture of experts' per-expert `experts.{e}.w1.weight` become one fused
`mlp.experts.gate_up_proj` [E, 2I, H], Mixtral's `block_sparse_moe` becomes `mlp`, Nemotron-H's `backbone`
becomes `model`. `save_pretrained` reverts it (`revert_weight_conversion`); the refit does the same with the
trainer's weights, so vLLM's own model definition maps them as it maps the checkpoint at start-up (its
`hf_to_vllm_mapper`, stacked parameters and expert mapping), with no table per family here. The refit check
(weight_digest.py) converts the sent weights the same way before it builds what the engine must serve.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import torch


@lru_cache(maxsize=4)
def skeleton(model_path: str) -> torch.nn.Module:
    """The model at `model_path` built on the meta device (no weights): what transformers' conversion reads."""
    from transformers import AutoConfig

    from reinforge.modeling import model_class

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return model_class(config).from_config(config)


def tied_names(model_path: str) -> dict[str, str]:
    """The model's tied weights: {tied name: the name of the weight it shares} (an LM head tied to the embedding)."""
    return dict(getattr(skeleton(model_path), "all_tied_weights_keys", None) or {})


def checkpoint_layout(
    model_path: str, named_tensors: Iterable[tuple[str, torch.Tensor]], drop: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """`named_tensors` (transformers' in-memory names and layout) in the layout of the checkpoint on disk, as
    `save_pretrained` writes them but for tied weights: those stay under both names (vLLM re-packs a tied LM head
    only when it is sent), but for the names in `drop` (tied names the engine has no parameter of: Gemma's)."""
    from transformers.core_model_loading import revert_weight_conversion

    dropped = set(drop)
    named = {name: tensor for name, tensor in named_tensors if name not in dropped}
    return dict(revert_weight_conversion(skeleton(model_path), named))


def engine_names(model: torch.nn.Module, sent_names: list[str]) -> tuple[dict[str, str], dict[str, dict]]:
    """Run inside vLLM's worker: what its model definition makes of the checkpoint names `sent_names`, for the
    refit check. (1) Each name its `hf_to_vllm_mapper` renames (renames only: fused parameters stay under their
    parts' names, which `packed_modules_mapping` joins). (2) For each fused-MoE parameter (`X.w13_weight`,
    `X.w2_weight`), the checkpoint names of its experts by shard (w1 gate, w3 up, w2 down), each in expert order,
    from the layer's own expert mapping (`get_expert_mapping`)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    renames = {}
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
        renames = {name: new for name in sent_names if (new := mapper.map_name(name)) not in (None, name)}
    experts: dict[str, dict] = {}
    for module_name, module in model.named_modules():
        if not (hasattr(module, "w13_weight") and hasattr(module, "get_expert_mapping")):
            continue
        # the layer loads checkpoint name `{layer_name}.{e}.{w1|w2|w3}.weight` (its mapping's `experts.{e}.w1.`)
        layer = getattr(module, "layer_name", module_name).removesuffix("experts")
        for param_name, weight_name, expert_id, shard_id in module.get_expert_mapping():
            if not weight_name.rstrip(".").rpartition(".")[0].rpartition(".")[2].isdigit():
                continue  # a fused checkpoint tensor's entry, not one expert's
            param = f"{module_name}.{param_name.rpartition('.')[2]}weight"
            experts.setdefault(param, {}).setdefault(shard_id, {})[expert_id] = f"{layer}{weight_name}weight"
    return renames, {
        param: {s: [n[e] for e in sorted(n)] for s, n in shards.items()} for param, shards in experts.items()
    }


def engine_tensors(sent: dict[str, torch.Tensor], renames: dict[str, str], experts: dict[str, dict]):
    """The checkpoint tensors `sent` under the engine's names (`engine_names`), Mamba's A as vLLM stores it, with
    each MoE layer's experts also stacked the way transformers holds them (`X.gate_up_proj` [E, 2I, H], gate rows
    then up; `X.down_proj` [E, H, I]), which the refit check takes apart per tensor-parallel worker
    (weight_digest.expert_tensor)."""
    named = {renames.get(name, name): tensor for name, tensor in sent.items()}
    for name, tensor in sent.items():  # vLLM's Mamba mixers load A_log as A = -exp(A_log) (mamba_mixer2.py)
        if name.endswith(".A_log") and renames.get(name, "").endswith(".A"):
            named[renames[name]] = -torch.exp(tensor.float())
    for param, shards in experts.items():
        layer = param.rpartition(".")[0].removesuffix(".routed_experts")
        parts = {shard: [named.get(name) for name in names] for shard, names in shards.items()}
        if any(t is None for ts in parts.values() for t in ts):
            continue  # the engine's weight then has no counterpart: the check says so
        if "w2" in parts:
            named[f"{layer}.down_proj"] = torch.stack(parts["w2"])
        if "w1" in parts and "w3" in parts:
            named[f"{layer}.gate_up_proj"] = torch.cat([torch.stack(parts["w1"]), torch.stack(parts["w3"])], dim=1)
    return named


def has_modules(worker, names: list[str]) -> list[bool]:
    """Run inside vLLM's worker: whether its model has the module of each weight name (`lm_head.weight`: lm_head)."""
    modules = dict(worker.model_runner.get_model().named_modules(remove_duplicate=False))
    return [name.rpartition(".")[0] in modules for name in names]
