"""What each rank holds and receives, recorded inside a rank's process, and what it should hold and receive, derived
from the layout alone (the Megatron/torchtitan conventions written out below), not from reinforge's plans.

- `held(model)`: every parameter's DTensor mesh dimension names, placements, global and local shape (a plain
  tensor: no mesh, no placements, local shape = global shape).
- `expected_held(...)`: the same table from the parameter's name and shape, the layout and the rank's coordinates
  in the mesh (`Layout.coordinates`, row-major over pp, dp_replicate, dp_shard, cp, tp as the training mesh is).
  The tensor-parallel split by role: vocabulary rows (embedding, LM head: Shard(0), 97 rows as 49 + 48), column-
  parallel projections (q/k/v, gate/up: output features, Shard(0), their biases too), row-parallel ones (o_proj,
  down_proj: input features, Shard(1), bias whole), norms between the blocks and per-head q/k norms Replicate
  (sequence parallel), fused experts on their intermediate dimension (the one that is not the hidden size); the
  final norm, routers, value heads and the attention's other parameters stay out of the tensor-parallel mesh.
  Experts are Shard(0) over `ep`; FSDP2 then shards dim 0 of what each rank holds over `dp_shard x cp` (the
  experts over `edp_shard`) and replicates over `dp_replicate`. FSDP2 marks a dim-0 shard of a tensor that is
  already dim-0-sharded `_StridedShard`: both are "sharded on dim d" here, the local shapes say the rest.
- `micro_batch_rows(backend, batch)`: the batch rows of each micro-batch the strategy hands this rank (matched by
  their tokens, not by its own index arithmetic); `watch_inputs(model)`: the token columns each forward of the
  model gets and the positions its first decoder layer sees; `assert_routing` checks them over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

ATTENTION = ("self_attn", "attention", "attn")
MLP = ("mlp", "feed_forward", "block_sparse_moe")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCABULARY = ("model.embed_tokens.weight", "lm_head.weight")


def _placement(placement) -> str:
    if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":  # the module docstring
        return f"S{placement.dim}"
    return "R" if isinstance(placement, Replicate) else type(placement).__name__


def held(model: torch.nn.Module) -> dict[str, tuple]:
    """{parameter name: (mesh dimension names, placements, global shape, local shape)}; (None, None, shape, shape)
    for a plain tensor."""
    table = {}
    for name, parameter in model.named_parameters():
        if isinstance(parameter, DTensor):
            mesh = tuple(parameter.device_mesh.mesh_dim_names)
            placements = tuple(_placement(p) for p in parameter.placements)
            table[name] = (mesh, placements, tuple(parameter.shape), tuple(parameter.to_local().shape))
        else:
            table[name] = (None, None, tuple(parameter.shape), tuple(parameter.shape))
    return table


@dataclass(frozen=True)
class Layout:
    """A training layout's degrees (`training.parallel`'s, dp_shard resolved). `pp` only places the ranks so far:
    the stages' expected tables (each stage's layers, the embedding on the first) are for when the pipeline lands."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's index along each mesh dimension (row-major, tp innermost), and the flattened ones."""
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        rank, shard = divmod(rank, self.dp_shard)
        pp, replicate = divmod(rank, self.dp_replicate)
        shard_cp = shard * self.cp + cp
        edp, ep = divmod(shard_cp, self.ep)
        dp = replicate * self.dp_shard + shard
        return dict(
            pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp, dp_shard_cp=shard_cp, edp=edp, ep=ep, dp=dp
        )


def _chunk(size: int, parts: int, index: int) -> int:
    """torch.chunk's (and DTensor's) share of `index`: ceil(size / parts) each, the last ones what is left."""
    step = -(-size // parts)
    return max(0, min(step, size - index * step))


def tensor_parallel_placement(name: str, shapes: dict[str, tuple], head_dim: int, transposed: bool) -> int | str | None:
    """The tensor-parallel split of parameter `name` (of a model whose parameters have `shapes`) by its role: the
    dimension it is sharded on, "R" (replicated), or None (not on the tensor-parallel mesh). Fused experts are
    transformers' gate_up_proj [E, 2I, H] and down_proj [E, H, I], or [E, H, 2I] and [E, I, H] when `transposed`
    (gpt-oss)."""
    if name in VOCABULARY:
        return 0
    parts = name.split(".")
    if ".experts." in name:
        if parts[-1] in ("gate_up_proj", "down_proj"):  # the intermediate dimension
            return 1 + ((parts[-1] == "down_proj") != transposed)
        return 1 if parts[-1] == "gate_up_proj_bias" else None  # down's bias is added once, whole
    if not name.startswith("model.layers."):
        return None  # the final norm, a value head: on the gathered hidden states
    block, module, kind = parts[3], parts[-2], parts[-1]
    if block not in ATTENTION + MLP:
        return "R" if len(shapes[name]) == 1 else None  # the norms between the blocks: sequence parallel
    linear = len(shapes.get(name.rsplit(".", 1)[0] + ".weight", ())) == 2
    if block in ATTENTION:
        if module in ("q_norm", "k_norm"):  # per-head (Qwen3's: the query's norm one head wide) on this rank's
            attention = name.rsplit(".", 2)[0]  # heads; whole-width ones (OLMo-2's) on gathered projections
            return "R" if shapes.get(f"{attention}.q_norm.weight") == (head_dim,) else None
        if not linear:
            return None  # MLA's norms, attention sinks: on gathered projections
        if module == "o_proj":
            return 1 if kind == "weight" else "R"
        return 0  # every other projection column-parallel (MLA's low-rank ones too, their outputs gathered)
    if not module.endswith("_proj"):
        return None  # a router, a shared expert's gate: on the gathered sequence, whole
    if module in ROW_PARALLEL:
        return 1 if kind == "weight" else "R"
    return 0


def expected_held(
    names_shapes: dict[str, tuple], layout: Layout, rank: int, head_dim: int, transposed: bool = False
) -> dict[str, tuple]:
    """`held`'s table for rank `rank` of `layout`, from each parameter's name and global shape alone (`head_dim`: the
    model's, for per-head norms; `transposed`: its fused experts' layout, `tensor_parallel_placement`)."""
    at = layout.coordinates(rank)
    table = {}
    for name, shape in names_shapes.items():
        tp_split = tensor_parallel_placement(name, names_shapes, head_dim, transposed) if layout.tp > 1 else None
        experts = layout.ep > 1 and ".experts." in name and name.split(".")[-1] in ("gate_up_proj", "down_proj")
        local = list(shape)
        mesh, placements = [], []
        if layout.dp_replicate > 1:
            mesh, placements = ["dp_replicate"], ["R"]
        if experts:
            local[0] = _chunk(local[0], layout.ep, at["ep"])
        if isinstance(tp_split, int):
            local[tp_split] = _chunk(local[tp_split], layout.tp, at["tp"])
        # FSDP2: dim 0 of what the rank holds, over the data-parallel (and context-parallel) shard ranks
        shards, index = (layout.dp_shard * layout.cp, at["dp_shard_cp"])
        if experts:
            shards, index = shards // layout.ep, at["edp"]
        local[0] = _chunk(local[0], shards, index)
        mesh.append("edp_shard" if experts else "dp_shard_cp")
        placements.append("S0")
        if experts:
            mesh.append("ep")
            placements.append("S0")
        if tp_split is not None:
            mesh.append("tp")
            placements.append("R" if tp_split == "R" else f"S{tp_split}")
        table[name] = (tuple(mesh), tuple(placements), tuple(shape), tuple(local))
    return table


def plain(names_shapes: dict[str, tuple]) -> dict[str, tuple]:
    """`held`'s table of a model in one process: plain tensors."""
    return {name: (None, None, tuple(shape), tuple(shape)) for name, shape in names_shapes.items()}


def assert_held(recorded: dict[str, tuple], expected: dict[str, tuple], where: str = "") -> None:
    """Every parameter held as expected: the differences listed (name: recorded != expected)."""
    assert recorded.keys() == expected.keys(), (where, sorted(recorded.keys() ^ expected.keys()))
    wrong = [f"{n}: {recorded[n]} != {expected[n]}" for n in expected if recorded[n] != expected[n]]
    assert not wrong, f"{where}: {len(wrong)} parameters held otherwise:\n" + "\n".join(wrong[:12])


def sharded_somewhere(recorded: dict[str, tuple]) -> bool:
    """Some parameter's local shape is smaller than its global one."""
    return any(local != shape for _, _, shape, local in recorded.values())


# --- what each rank receives ----------------------------------------------------------------------------


def _tokens(batch, row: int) -> tuple[int, ...]:
    return tuple(batch.input_ids[row][batch.attention_mask[row].bool()].tolist())


def micro_batch_rows(backend, batch) -> list[list[int]]:
    """The rows of `batch` in each micro-batch the backend's strategy gives this rank, found by their tokens."""
    index = {_tokens(batch, row): row for row in range(len(batch))}
    assert len(index) == len(batch), "the batch's rows must be distinct to be told apart"
    return [
        sorted(index[_tokens(micro, row)] for row in range(len(micro)))
        for _, micro, _ in backend.strategy.micro_batches(batch, backend.plan)
    ]


def watch_inputs(model: torch.nn.Module) -> dict[str, list]:
    """Hooks on `model` (and its first decoder layer): each forward's input_ids (clone), and the positions of the
    hidden states the first decoder layer receives (its sequence-parallel share under tp); `seen["handles"]`."""
    seen: dict[str, list] = {"input_ids": [], "layer_width": []}

    def root(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen["input_ids"].append(ids.detach().cpu().clone())

    def layer(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen["layer_width"].append(hidden.shape[1])

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    seen["handles"] = [
        model.register_forward_pre_hook(root, with_kwargs=True),
        decoder.layers[0].register_forward_pre_hook(layer, with_kwargs=True),
    ]
    return seen


def inputs_record(seen: dict[str, list]) -> dict[str, list]:
    """The hooks removed; what they saw, to save with a rank's results."""
    for handle in seen.pop("handles"):
        handle.remove()
    return seen


def assert_routing(rows: list[list[list[int]]], inputs: list[dict] | None, layout: Layout, num_rows: int) -> None:
    """Over the ranks (`rows[rank]`: `micro_batch_rows`; `inputs[rank]`: `inputs_record`): ranks of one tp or cp
    group (same data-parallel coordinate) get the same rows, ranks of different ones disjoint rows that together
    are the batch; tp peers get the same token columns and their first layer 1/tp of them; cp peers different
    columns (their chunks) of one width."""
    assert len(rows) == layout.world
    coordinates = [layout.coordinates(rank) for rank in range(layout.world)]
    by_dp: dict[int, list[int]] = {}
    for rank, at in enumerate(coordinates):
        by_dp.setdefault(at["dp"], []).append(rank)
    assert len(by_dp) == layout.dp_replicate * layout.dp_shard
    shares = []
    for dp, ranks in by_dp.items():
        assert all(rows[r] == rows[ranks[0]] for r in ranks), ("a tp/cp group got different rows", dp, rows)
        shares.append({row for micro in rows[ranks[0]] for row in micro})
    union = set().union(*shares)
    assert sum(len(share) for share in shares) == len(union) == num_rows, ("dp ranks' rows overlap or miss", shares)
    if inputs is None:
        return
    for rank, at in enumerate(coordinates):
        ids, widths = inputs[rank]["input_ids"], inputs[rank]["layer_width"]
        assert ids and len(widths) == len(ids), (rank, len(ids), len(widths))
        assert [w * layout.tp for w in widths] == [i.shape[1] for i in ids], ("first layer's positions", rank, widths)
        tp_peer = rank - at["tp"]  # tp rank 0 of this group
        assert all(torch.equal(a, b) for a, b in zip(ids, inputs[tp_peer]["input_ids"], strict=True)), rank
        if layout.cp > 1 and at["cp"] > 0:
            cp_peer = rank - at["cp"] * layout.tp  # cp rank 0 of this group
            theirs = inputs[cp_peer]["input_ids"]
            assert [i.shape for i in ids] == [i.shape for i in theirs], rank
            assert not all(torch.equal(a, b) for a, b in zip(ids, theirs)), ("cp peers got the same columns", rank)
