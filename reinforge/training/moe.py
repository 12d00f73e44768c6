"""Mixture-of-experts in the trainer: router replay and the routing metrics (docs/moe.md, docs/metrics.md).

A softmax top-k router (`mlp.gate` of Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral and the models that share their
router) maps each token's hidden state to logits over the E experts and returns (logits [N, E], scores [N, K],
indices [N, K]): the K experts of highest probability softmax(logits) and their probabilities, renormalised over
the K when `norm_topk_prob` (Mixtral: always). `MoeRouting` puts a forward hook on every router of one model:

- router replay (`model.moe.router_replay: rollout`): where the generation engine recorded a token's experts
  (`TrainBatch.routed_experts`, mapped to the forward's packed, prompt-sharing or padded layout by
  `forward_routes`), the hook replaces the router's indices by them and its scores by the probabilities of those
  experts, renormalised as the router renormalises its own choice. The scores stay a function of the logits, so
  the router's weight still gets a gradient; tokens without a recorded route keep the router's own choice.
- capture: each layer's logits, the router's own top-k and the experts actually used, at the real tokens; the
  metrics and the auxiliary load-balancing loss are computed from them (`forward_metrics`).

The state is set per forward by the micro-batching code (`prepare`, from `trained_hidden_states`) and kept until
the next forward, so activation checkpointing's recompute in the backward pass routes the same way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reinforge.data.batch import TrainBatch
from reinforge.data.packing import RowLayout
from reinforge.errors import ConfigError
from reinforge.modeling import moe_routers


def check_replayable(model: torch.nn.Module) -> None:
    """A one-line error unless router replay can force this MoE model's routes."""
    model_type = model.config.get_text_config().model_type
    if not moe_routers(model):
        raise ConfigError(
            f"model.moe.router_replay=rollout does not support {model_type}'s router yet (supported: the softmax "
            "top-k routers of Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral); set model.moe.router_replay=off"
        )


def forced_scores(logits_NE: torch.Tensor, indices_NK: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """The router's scores for experts `indices_NK`: their probabilities under softmax(logits) (in fp32), divided
    by their sum when the router renormalises its top-k; what the router computes for its own choice."""
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float)
    scores_NK = probs_NE.gather(-1, indices_NK)
    return scores_NK / scores_NK.sum(dim=-1, keepdim=True) if renormalise else scores_NK


@dataclass
class ForwardRoutes:
    """One forward's tokens in the forward's slot order (row * W + column, this rank's chunk of columns with
    context parallelism)."""

    real_N: torch.Tensor  # [N] bool: a token of some sequence (not padding)
    weight_N: torch.Tensor  # [N] float: how many sequence tokens the slot stands for (a shared prompt: several)
    routes_NLK: torch.Tensor | None  # [N, L, K] long: the engine's experts, -1 where none was recorded


def forward_routes(micro: TrainBatch, layout: RowLayout, chunk=None) -> ForwardRoutes:
    """The micro-batch's real tokens, their multiplicities and recorded routes [B, T, L, K] moved to the layout's
    slots (`layout.token_index`); with `chunk` (a `SequenceChunk`) only its columns."""
    real_BT = micro.attention_mask.bool()
    slots_n = layout.token_index[real_BT]
    num_slots = layout.num_slots
    weight_N = torch.bincount(slots_n, minlength=num_slots).float()
    routes = None
    if micro.routed_experts is not None:
        routes_BTLK = micro.routed_experts.to(slots_n.device)
        routes = routes_BTLK.new_full((num_slots, *routes_BTLK.shape[2:]), -1)
        routes[slots_n] = routes_BTLK[real_BT]  # a shared prompt's copies write the same slot
    if chunk is not None:
        weight_N, routes = (None if t is None else _columns(t, layout, chunk) for t in (weight_N, routes))
    return ForwardRoutes(weight_N > 0, weight_N, routes)


def _columns(slots: torch.Tensor, layout: RowLayout, chunk) -> torch.Tensor:
    """Per-slot values [R * W, ...] restricted to the chunk's columns, as [R * (end - start), ...]."""
    rows, width = layout.input_ids.shape
    per_row = slots.view(rows, width, *slots.shape[1:])
    pad = slots.new_full((rows, chunk.padded_width - width, *slots.shape[1:]), -1 if slots.dtype == torch.long else 0)
    return torch.cat([per_row, pad], dim=1)[:, chunk.start : chunk.end].flatten(0, 1)


@dataclass
class LayerRouting:
    """One router's call in a forward, at the real tokens."""

    logits_NE: torch.Tensor  # with its gradient
    own_NK: torch.Tensor  # the router's own top-k
    used_NK: torch.Tensor  # the experts the layer computed (the forced ones where replayed)


_ROUTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, MoeRouting]" = weakref.WeakKeyDictionary()


def model_routing(model: torch.nn.Module) -> "MoeRouting | None":
    """The `MoeRouting` attached to `model`, or None (a dense model, or one trained without it)."""
    return _ROUTINGS.get(model)


class MoeRouting:
    """Forward hooks on a model's routers: replay of recorded routes (`replay`) and capture of the routing."""

    def __init__(self, model: torch.nn.Module, replay: bool):
        if replay:
            check_replayable(model)
        self.routers = moe_routers(model)
        assert self.routers, "MoeRouting on a model without softmax top-k routers"
        self.replay = replay
        self.num_experts, self.top_k = self.routers[0].num_experts, self.routers[0].top_k
        self.current: ForwardRoutes | None = None
        self.captured: dict[int, LayerRouting] = {}
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook_for(layer))
        _ROUTINGS[model] = self

    def prepare(self, micro: TrainBatch, layout: RowLayout, chunk=None) -> None:
        """Route the next forward (and its recompute) over this micro-batch's layout."""
        routes = micro.routed_experts
        expected = (len(self.routers), self.top_k)
        if routes is not None and tuple(routes.shape[2:]) != expected:
            raise ConfigError(
                f"the recorded routes are [tokens, {routes.shape[2]} layers, top-{routes.shape[3]}] but the trained "
                f"model has {expected[0]} MoE layers of top-{expected[1]}: train the model the engine generated with"
            )
        self.current = forward_routes(micro, layout, chunk)
        self.captured = {}

    def clear(self) -> None:
        self.current, self.captured = None, {}

    def _hook_for(self, layer: int):
        def hook(module: torch.nn.Module, args, output):
            if self.current is None:
                return None
            logits_NE, scores_NK, indices_NK = output
            own_NK, routes = indices_NK, self.current.routes_NLK
            if self.replay and routes is not None:
                forced_NK = routes[:, layer]
                use_N1 = (forced_NK >= 0).all(dim=-1, keepdim=True)
                indices_NK = torch.where(use_N1, forced_NK, own_NK)
                renormalise = getattr(module, "norm_topk_prob", True)
                forced = forced_scores(logits_NE, indices_NK, renormalise).to(scores_NK.dtype)
                scores_NK = torch.where(use_N1, forced, scores_NK)
            real = self.current.real_N
            self.captured[layer] = LayerRouting(logits_NE[real], own_NK[real].detach(), indices_NK[real].detach())
            return logits_NE, scores_NK, indices_NK

        return hook

    def statistics(self, group: dist.ProcessGroup | None = None) -> "RoutingStatistics":
        """The last forward's routing sums (over the cp `group` when given: each rank holds a chunk of columns)."""
        assert self.current is not None and len(self.captured) == len(self.routers), "no routed forward to measure"
        layers = [self.captured[i] for i in range(len(self.routers))]
        real = self.current.real_N
        weights = self.current.weight_N[real]
        routes = None if self.current.routes_NLK is None else self.current.routes_NLK[real]
        stats = routing_statistics(layers, weights, routes, self.num_experts)
        return stats if group is None else stats.summed_over(group)


@dataclass
class RoutingStatistics:
    """Weighted sums over one forward's tokens (weights: sequence tokens per slot), per layer l and expert e."""

    num_tokens: torch.Tensor  # []
    used_load_LE: torch.Tensor  # token-slots routed to each expert (the experts computed)
    own_load_LE: torch.Tensor  # the same for the router's own top-k
    prob_sum_LE: torch.Tensor  # sum of softmax(logits): differentiable, for the auxiliary loss
    entropy_sum_L: torch.Tensor
    recorded_L: torch.Tensor  # tokens with a recorded route
    disagree_L: torch.Tensor  # of those, own top-k set != the recorded set
    replayed_L: torch.Tensor  # of those, used set == the recorded set

    def summed_over(self, group: dist.ProcessGroup) -> "RoutingStatistics":
        """The group's sums on every rank; the probabilities' gradient flows back to this rank's own tokens
        (training/parallel/context.py, `sum_over_group`)."""
        from reinforge.training.parallel.context import sum_over_group

        names = list(vars(self))
        flat = torch.cat([getattr(self, n).float().flatten() for n in names])
        summed = sum_over_group(flat, group)
        parts = summed.split([getattr(self, n).numel() for n in names])
        return RoutingStatistics(*(p.view(getattr(self, n).shape) for n, p in zip(names, parts)))


def _load(indices_NK: torch.Tensor, weights_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    load = weights_N.new_zeros(num_experts)
    return load.index_add_(0, indices_NK.flatten(), weights_N.repeat_interleave(indices_NK.shape[1]))


def _same_set(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    return (a_NK.sort(dim=-1).values == b_NK.sort(dim=-1).values).all(dim=-1)


def routing_statistics(
    layers: list[LayerRouting], weights_N: torch.Tensor, routes_NLK: torch.Tensor | None, num_experts: int
) -> RoutingStatistics:
    """The sums of `RoutingStatistics` from each layer's captured routing at the real tokens."""
    used, own, probs, entropy, recorded, disagree, replayed = ([] for _ in range(7))
    for layer, routing in enumerate(layers):
        logp_NE = torch.log_softmax(routing.logits_NE.float(), dim=-1)
        p_NE = logp_NE.exp()
        used.append(_load(routing.used_NK, weights_N, num_experts))
        own.append(_load(routing.own_NK, weights_N, num_experts))
        probs.append((p_NE * weights_N[:, None]).sum(dim=0))
        entropy.append((-(p_NE * logp_NE).sum(dim=-1).detach() * weights_N).sum())
        if routes_NLK is None:
            recorded.append(weights_N.new_zeros(()))
            disagree.append(weights_N.new_zeros(()))
            replayed.append(weights_N.new_zeros(()))
            continue
        route_NK = routes_NLK[:, layer]
        has_N = (route_NK >= 0).all(dim=-1).float() * weights_N
        recorded.append(has_N.sum())
        disagree.append((has_N * ~_same_set(routing.own_NK, route_NK)).sum())
        replayed.append((has_N * _same_set(routing.used_NK, route_NK)).sum())
    return RoutingStatistics(
        weights_N.sum(), *(torch.stack(x) for x in (used, own, probs, entropy, recorded, disagree, replayed))
    )


@dataclass(frozen=True)
class RoutedTokens:
    """The global batch's counts the routing metrics divide by (every rank's micro-batches together)."""

    num_tokens: int  # real (sequence) tokens
    num_recorded: int  # of those, with a recorded route
    has_routes: bool  # the batch carries routes (so every global batch of a step logs the same names)

    @staticmethod
    def of(batch: TrainBatch) -> "RoutedTokens":
        real_BT = batch.attention_mask.bool()
        if batch.routed_experts is None:
            return RoutedTokens(int(real_BT.sum()), 0, False)
        recorded_BT = (batch.routed_experts >= 0).flatten(2).all(dim=-1) & real_BT.to(batch.routed_experts.device)
        return RoutedTokens(int(real_BT.sum()), int(recorded_BT.sum()), True)


def load_balancing_loss(stats: RoutingStatistics) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers' `load_balancing_loss_func` computes it over one forward:
    E * sum_e f_e P_e, f_e = the router's own top-k assignments to e / (N L), P_e = sum of p_e / (N L), over the
    N tokens and L layers together. Differentiable through P."""
    num_layers, num_experts = stats.prob_sum_LE.shape
    scale = (stats.num_tokens * num_layers).clamp(min=1)
    f_E = stats.own_load_LE.sum(dim=0) / scale
    p_E = stats.prob_sum_LE.sum(dim=0) / scale
    return num_experts * (f_E * p_E).sum()


def forward_metrics(stats: RoutingStatistics, counts: RoutedTokens, replay: bool) -> dict[str, torch.Tensor]:
    """One forward's contributions to the routing metrics, summable over micro-batches and data-parallel ranks:
    each per-forward value weighted by the forward's share of the global batch's tokens (token means: exact for
    entropy and the route shares; a token-weighted mean of the per-forward values for the load's CV, the hottest
    expert's share and the auxiliary loss). `moe/aux_loss` keeps its gradient; the others are detached."""
    num_layers, num_experts = stats.used_load_LE.shape
    weight = stats.num_tokens / max(counts.num_tokens, 1)
    top_k = stats.used_load_LE.sum(dim=-1, keepdim=True).clamp(min=1e-12)  # N * K per layer
    share_LE = (stats.used_load_LE / top_k).detach()
    cv_L = share_LE.std(dim=-1, unbiased=False) / share_LE.mean(dim=-1).clamp(min=1e-12)  # 0 without tokens
    metrics = {
        "moe/aux_loss": load_balancing_loss(stats) * weight,
        "moe/load_cv": cv_L.mean() * weight,
        "moe/max_expert_share": share_LE.max() * weight,
        "moe/router_entropy": stats.entropy_sum_L.mean() / max(counts.num_tokens, 1),
    }
    metrics.update({f"moe/load_cv_layer{i}": cv * weight for i, cv in enumerate(cv_L)})
    if counts.has_routes:
        metrics["moe/router_disagreement"] = stats.disagree_L.mean() / max(counts.num_recorded, 1)
        if replay:
            metrics["moe/replayed_share"] = stats.replayed_L.mean() / max(counts.num_recorded, 1)
    return {name: value if name == "moe/aux_loss" else value.detach() for name, value in metrics.items()}


def clear_routing(model: torch.nn.Module) -> None:
    """Forget an MoE model's last routed forward (its routes and captured logits), so no later forward of the
    model (a generation engine's, say) replays them."""
    if (routing := model_routing(model)) is not None:
        routing.clear()
