"""Tinker's built-in losses, each a pure function of one datum's target logprobs (N,) and its loss_fn_inputs.

Every loss is a SUM over the datum's positions (Tinker's convention: no mean; a client that wants one puts it in
its weights or advantages), and a request's loss is the sum over its datums. In the formulas, lp is the trained
policy's logprob of each target token, q the sampler's (`logprobs`), A the advantage, r = exp(lp - q) and sg a
stop-gradient:

- `cross_entropy`: -sum(w * lp); target_tokens and weights (N,) or (N, K) (K targets per position: top-k
  distillation); the SDK's client-side custom losses arrive as this loss with weights -dC/dlp.
- `importance_sampling`: -sum(r * A).
- `ppo`: -sum(min(r * A, clip(r, lo, hi) * A)), lo/hi `clip_low_threshold`/`clip_high_threshold` (0.8, 1.2).
- `cispo`: -sum(sg(clip(r, lo, hi)) * lp * A), the same thresholds.
- `dro`: -sum(lp * A - beta / 2 * (lp - q)^2), `beta` 0.05.
- `gspo` (GSPO-token): every position's ratio has the value of the sequence ratio s = exp(mean of sg(lp) - q over
  the positions `sequence_ratio_mask` marks) and the gradient of its own lp; then ppo's clipped objective. Without
  the mask, the positions with a nonzero advantage.
- `stable_reinforce`: Tinker does not publish its formula (it reads information its sampler records); here it is
  REINFORCE with a truncated importance weight, -sum(sg(min(r, hi)) * lp * A) over the positions the datum's
  provenance names sampled tokens (`clip_high_threshold`, 2.0), which equals the importance-sampling gradient on
  policy and stays bounded off policy. Advantages on prompt positions are an error, as in Tinker.

The clip thresholds may also come per position, as loss_fn_inputs of the same names (the SDK types them).
Outputs per datum: `logprobs` (the target logprobs); metrics: `loss:sum`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from reinforge.tinker.datum import Datum
from reinforge.tinker.errors import TinkerRequestError

LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": CLIPS,
    "cispo": CLIPS,
    "dro": {"beta": 0.05},
    "gspo": CLIPS,
    "stable_reinforce": {"clip_high_threshold": 2.0},
}
POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    **{name: POLICY_INPUTS for name in LOSS_NAMES[1:]},
}
OPTIONAL: dict[str, tuple[str, ...]] = {
    "ppo": tuple(CLIPS),
    "cispo": tuple(CLIPS),
    "gspo": ("sequence_ratio_mask", *CLIPS),
    "stable_reinforce": ("clip_high_threshold",),
}
SAMPLED = "sampled"  # the input under which the trainer hands a datum's provenance (`Datum.sampled`) to the loss


def inputs_read(loss_fn: str, datum: Datum) -> tuple[str, ...]:
    """The loss_fn_inputs `loss_fn` reads of this datum (target_tokens first), in a fixed order."""
    return REQUIRED[loss_fn] + tuple(name for name in OPTIONAL.get(loss_fn, ()) if name in datum.inputs)


def check_inputs(loss_fn: str, config: dict[str, float | str], datums: list[Datum]) -> None:
    """A one-line `TinkerRequestError` for the first problem of a request: an unknown loss or config key, a config
    value that is not a finite number, a datum without tokens or without an input the loss needs, an input of the
    wrong shape or length, a non-finite value, a `stable_reinforce` datum without provenance or with an advantage
    on a prompt position."""
    if loss_fn not in LOSS_NAMES:
        raise TinkerRequestError(
            f"unknown loss_fn {loss_fn!r}; the built-in losses are {', '.join(LOSS_NAMES)} (a custom loss runs "
            "client-side through forward_backward_custom)"
        )
    known = DEFAULTS[loss_fn]
    for key, value in config.items():
        if key not in known:
            keys = ", ".join(known) or "none"
            raise TinkerRequestError(f"loss_fn_config key {key!r} is not one of {loss_fn}'s ({keys})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TinkerRequestError(f"loss_fn_config[{key!r}]={value!r} must be a finite number")
    if not datums:
        raise TinkerRequestError("the request has no datums")
    for index, datum in enumerate(datums):
        check_datum(loss_fn, index, datum)


def check_datum(loss_fn: str, index: int, datum: Datum) -> None:
    where, length = f"datum {index}", len(datum.tokens)
    if length == 0:
        raise TinkerRequestError(f"{where} has an empty model_input; every datum needs at least one token")
    for name in REQUIRED[loss_fn]:
        if name not in datum.inputs:
            needs = ", ".join(REQUIRED[loss_fn])
            raise TinkerRequestError(f"{where} has no loss_fn_inputs[{name!r}], which {loss_fn} needs ({needs})")
    shape = (length,)
    if loss_fn == "cross_entropy" and np.ndim(datum.inputs["target_tokens"]) == 2:  # K targets per position
        shape = (length, np.shape(datum.inputs["target_tokens"])[1])
    for name in inputs_read(loss_fn, datum):
        value = np.asarray(datum.inputs[name], dtype=np.float64)
        if value.shape != shape:
            raise TinkerRequestError(
                f"{where}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}, but the datum's model_input has "
                f"{length} tokens: it needs shape {list(shape)}, one row per input token"
            )
        if not np.isfinite(value).all():
            position = int(np.argwhere(~np.isfinite(value))[0][0])
            raise TinkerRequestError(f"{where}: loss_fn_inputs[{name!r}] is NaN or infinite at position {position}")
    targets = np.asarray(datum.inputs["target_tokens"], dtype=np.float64)
    if (targets < 0).any() or (targets != np.round(targets)).any():
        raise TinkerRequestError(f"{where}: loss_fn_inputs['target_tokens'] must hold token ids (integers >= 0)")
    if loss_fn == "stable_reinforce":
        check_provenance(where, datum)


def check_provenance(where: str, datum: Datum) -> None:
    if datum.sampled is None or np.shape(datum.sampled) != (len(datum.tokens),):
        raise TinkerRequestError(
            f"{where} has no provenance; stable_reinforce trains the sampled tokens it names: build each datum with "
            "Datum.with_provenance from the sampled sequence's sequence_id"
        )
    prompt = (np.asarray(datum.sampled) == 0) & (np.asarray(datum.inputs["advantages"]) != 0)
    if prompt.any():
        raise TinkerRequestError(
            f"{where} has a nonzero advantage at position {int(np.argmax(prompt))}, which its provenance names a "
            "prompt token; stable_reinforce takes advantages on sampled tokens only"
        )


def datum_loss(
    loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float | str]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's loss (a sum over its positions) from its target logprobs `lp` (N,), or (N, K) for a wide
    cross_entropy, with their gradient; and its outputs ({"logprobs": lp}). `inputs` as `check_inputs` passed them,
    as tensors (with `SAMPLED` for stable_reinforce); `config` without its defaults."""
    settings = {**DEFAULTS[loss_fn], **config}
    clip = {key: inputs.get(key, settings.get(key)) for key in CLIPS}
    outputs = {"logprobs": lp.detach()}
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"]).sum(), outputs
    q, advantages = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        loss = -(ratio * advantages).sum()
    elif loss_fn == "ppo":
        loss = -clipped_objective(ratio, advantages, clip["clip_low_threshold"], clip["clip_high_threshold"])
    elif loss_fn == "cispo":
        kept = clamp(ratio, clip["clip_low_threshold"], clip["clip_high_threshold"]).detach()
        loss = -(kept * lp * advantages).sum()
    elif loss_fn == "dro":
        loss = -(lp * advantages - 0.5 * settings["beta"] * (lp - q) ** 2).sum()
    elif loss_fn == "gspo":
        marked = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else advantages != 0
        log_ratio = (lp.detach() - q)[marked].mean() if marked.any() else lp.new_zeros(())
        sequence_ratio = torch.exp(log_ratio + lp - lp.detach())
        loss = -clipped_objective(sequence_ratio, advantages, clip["clip_low_threshold"], clip["clip_high_threshold"])
    else:  # stable_reinforce
        weight = torch.minimum(
            ratio, torch.as_tensor(clip["clip_high_threshold"], dtype=lp.dtype, device=lp.device)
        ).detach()
        loss = -(inputs[SAMPLED] * weight * lp * advantages).sum()
    return loss, outputs


def clamp(ratio: torch.Tensor, low, high) -> torch.Tensor:
    """`ratio` clipped to [low, high]: numbers, or tensors of thresholds per position."""
    low, high = (torch.as_tensor(bound, dtype=ratio.dtype, device=ratio.device) for bound in (low, high))
    return torch.minimum(torch.maximum(ratio, low), high)


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, low, high) -> torch.Tensor:
    """PPO's pessimistic objective summed over positions: min(r * A, clip(r, low, high) * A)."""
    return torch.minimum(ratio * advantages, clamp(ratio, low, high) * advantages).sum()
