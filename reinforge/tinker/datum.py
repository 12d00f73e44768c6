"""One Tinker training example as the server's trainer takes it, decoded from the SDK's wire `Datum`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Datum:
    """Position i of `tokens` predicts `inputs["target_tokens"][i]` (any id: a prompt position's target is often 0
    with weight 0); every input has one row per token."""

    tokens: list[int]
    """model_input's text chunks concatenated."""
    inputs: dict[str, np.ndarray]
    """loss_fn_inputs by name, each (N,), or (N, K) where the loss takes K targets per position (cross_entropy)."""
    sampled: np.ndarray | None = None
    """(N,) 1.0 where the datum's provenance (`loss_fn_input_spans`) names a token its sampled sequence produced
    (a `SampledProvenanceSpan`), 0.0 where it names a prompt token; None for a datum sent without provenance.
    `stable_reinforce` needs it."""
