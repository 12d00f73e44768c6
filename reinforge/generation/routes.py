"""Recording a mixture-of-experts model's routes (the experts each token was sent to) while it generates, for
router replay (docs/moe.md): the trainer's forward later sends every token to the experts the engine used.

A route is, per token, the `top_k` expert indices of every MoE layer: an array [tokens, MoE layers, top_k].
Convention (vLLM's `CompletionOutput.routed_experts`, which every engine follows): a completion's routes cover
the tokens the engine ran through the model, in order: the whole prompt, then every generated token but the
last. The last sampled token is never fed back (generation ends once it is sampled), so no forward ever routed
it; nothing is trained on its route either (its output would predict the token after it). So a completion of
P prompt and N generated tokens has P + N - 1 routes, and `collate` marks the last token as having none (-1).

The routers are the softmax top-k ones the trainer can replay (modeling.py `moe_routers`: the Qwen-MoE family,
Mixtral, OLMoE, ...): each forward returns (router_logits [N, E], router_scores [N, K], router_indices [N, K]) for the
N tokens of the call, flattened from [batch, sequence].
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn

from reinforge.errors import ReinforgeError
from reinforge.modeling import moe_routers


def route_dtype(num_experts: int) -> np.dtype:
    """uint8 while every expert index fits (up to 256 experts, as vLLM), else int16."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16)


class RouteRecorder:
    """The routes of every forward call made while `recording`: one [N, L, K] tensor per call."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ReinforgeError(
                f"routes were asked of {type(model).__name__}, which has no mixture-of-experts router reinforge can "
                "replay (a softmax top-k router: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral); set model.moe.router_replay=off"
            )
        self.dtype = route_dtype(self.routers[0].num_experts)
        self._by_layer: list[list[torch.Tensor]] = [[] for _ in self.routers]

    @contextmanager
    def recording(self) -> Iterator["RouteRecorder"]:
        """Hooks on every router for the duration: they read the indices and change nothing."""
        for calls in self._by_layer:
            calls.clear()
        handles = [
            router.register_forward_hook(
                lambda _module, _inputs, output, calls=calls: calls.append(output[2].detach().cpu())
            )
            for router, calls in zip(self.routers, self._by_layer)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def calls(self) -> list[torch.Tensor]:
        """Each recorded forward call's routes, [N, L, K] (N: the call's tokens, batch and sequence flattened)."""
        num_calls = {len(calls) for calls in self._by_layer}
        assert len(num_calls) == 1, f"routers called unevenly: {num_calls}"
        return [torch.stack(layers, dim=1) for layers in zip(*self._by_layer)]


def generation_routes(calls: list[torch.Tensor], batch_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.generate`'s routes split into the prefill's, [B, width, L, K] (left-padded prompts), and the decode
    calls', [B, calls - 1, L, K]: decode call i ran generated token i - 1 of every row."""
    prefill, *decode = calls
    assert prefill.shape[0] == batch_size * width, "generate did not prefill the whole prompt in one call"
    prefill_BWLK = prefill.view(batch_size, width, *prefill.shape[1:])
    if not decode:
        return prefill_BWLK, prefill.new_zeros((batch_size, 0, *prefill.shape[1:]))
    assert all(call.shape[0] == batch_size for call in decode), "a decode call ran more than one token per row"
    return prefill_BWLK, torch.stack(decode, dim=1)


def row_routes(
    prefill_BWLK: torch.Tensor, decode_BDLK: torch.Tensor, row: int, prompt_len: int, num_generated: int, dtype
) -> np.ndarray:
    """Row `row`'s routes by the convention above: its prompt's (left padding stripped) and those of its first
    `num_generated - 1` generated tokens."""
    width = prefill_BWLK.shape[1]
    prompt = prefill_BWLK[row, width - prompt_len :]
    generated = decode_BDLK[row, : max(num_generated - 1, 0)]
    return torch.cat([prompt, generated]).numpy().astype(dtype)
