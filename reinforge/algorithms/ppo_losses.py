"""PPO's critic-side math as pure tensor functions: token rewards, GAE, the clipped value loss, whitening
and explained variance.

Shapes: B sequences, T positions, with the position convention of data/batch.py: column t is token
`input_ids[b, t]`, and `mask_BT` is 1 on the tokens the policy generated (the actions). A value
`values_BT[b, t]` is V(s_t), the critic's estimate of the return from the state *before* token t
(it is read from the hidden state of token t - 1, as the logprob of token t is): the state in which
action t is taken. The episode ends after the last action of a row; V there is 0.

GAE (Schulman et al. 2016, arXiv:1506.02438), over the actions of a row in order, skipping the
positions off the mask (prompt, padding, environment tokens inside a multi-turn answer):
    delta_t = r_t + gamma * V(next action's state) - V(s_t)          (0 for V after the last action)
    A_t     = delta_t + gamma * lambda * A_(next action)
    R_t     = A_t + V(s_t)                                           (the critic's regression target)
The positions off the mask carry the running V and A through unchanged ("carry-forward", as in
NeMo-RL's GeneralizedAdvantageEstimator), so an environment observation inside an answer adds no
phantom step; gamma and lambda count actions, not positions.

The value loss is PPO's clipped regression (as in veRL's compute_value_loss and NeMo-RL's
MseValueLossFn, from OpenAI's baselines):
    V_clip = V_old + clamp(V - V_old, -eps_v, +eps_v)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)
aggregated per token with the global-batch normaliser (losses.token_mean), so gradient accumulation
gives the gradient of the whole batch.
"""

from __future__ import annotations

import torch

from reinforge.algorithms.losses import metric_mean, token_mean
from reinforge.data.batch import Normalisers


def terminal_rewards(rewards_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T]: each sequence's reward on its last action (the last 1 of its mask), 0
    elsewhere; a row with no action gets none."""
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT > 0, positions_BT, -1).max(dim=1).values
    rewards_BT = torch.zeros_like(mask_BT, dtype=torch.float32)
    has_action = last_B >= 0
    rewards_BT[has_action.nonzero().flatten(), last_B[has_action]] = rewards_B[has_action].float()
    return rewards_BT


def gae(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BT, returns_BT), both 0 off the mask, by the backward recursion in the module
    docstring. Positions off the mask neither read their reward nor their value."""
    num_rows, width = mask_BT.shape
    next_value_B = values_BT.new_zeros(num_rows)
    next_advantage_B = values_BT.new_zeros(num_rows)
    advantages_BT = torch.zeros_like(values_BT)
    for t in reversed(range(width)):
        valid_B = mask_BT[:, t] > 0
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        advantages_BT[:, t] = torch.where(valid_B, advantage_B, 0.0)
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        next_advantage_B = torch.where(valid_B, advantage_B, next_advantage_B)
    returns_BT = (advantages_BT + values_BT) * mask_BT
    return advantages_BT, returns_BT


def masked_mean_std(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population standard deviation over the valid tokens."""
    count = mask_BT.sum().clamp(min=1)
    mean = (values_BT * mask_BT).sum() / count
    variance = (((values_BT - mean) * mask_BT) ** 2).sum() / count
    return mean, variance.sqrt()


def whiten_tokens(values_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """PPO's advantage normalisation over the n valid tokens of the batch (each token weighs once), 0 off the mask:
        mean = sum_t x_t / n,   var = sum_t (x_t - mean)^2 / (n - 1)   (Bessel-corrected),
        x_t <- (x_t - mean) / sqrt(var + eps)                           (eps = 1e-8, inside the square root)
    as veRL's masked_whiten (verl/utils/torch_functional.py, masked_var with unbiased=True) and NeMo-RL's GAE
    whitening (GeneralizedAdvantageEstimator with normalize_advantages, nemo_rl/algorithms/utils.py's
    masked_var, unbiased) compute it. The whitened tokens have mean 0 and Bessel-corrected std 1 (population
    std sqrt((n - 1) / n)). With one valid token (n - 1 = 0: an error in veRL) the token is 0, as its x - mean."""
    count = mask_BT.sum()
    mean = (values_BT * mask_BT).sum() / count.clamp(min=1)
    variance = (((values_BT - mean) * mask_BT) ** 2).sum() / (count - 1).clamp(min=1)
    return (values_BT - mean) * torch.rsqrt(variance + eps) * mask_BT


def explained_variance(returns_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the valid tokens: 1 for a critic that predicts the returns, 0 for one no
    better than their mean, negative for worse. 0 when the returns do not vary."""
    _, residual_std = masked_mean_std(returns_BT - values_BT, mask_BT)
    _, returns_std = masked_mean_std(returns_BT, mask_BT)
    if returns_std == 0:
        return returns_std
    return 1 - residual_std**2 / returns_std**2


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    norm: Normalisers,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss of one micro-batch (module docstring; `clip=None`: the plain 0.5 (V - R)^2), scaled
    so that micro-batch losses sum to the global batch's. Metric contributions sum over micro-batches too:
    `value_loss`, `value_clip_fraction` (tokens where the clipped term is the larger, so V gets no gradient),
    `value_mean` (of V)."""
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        per_token_BT, clipped_BT = 0.5 * unclipped_BT, torch.zeros_like(unclipped_BT)
    else:
        near_old_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -clip, clip)
        clipped_sq_BT = (near_old_BT - returns_BT) ** 2
        per_token_BT = 0.5 * torch.maximum(unclipped_BT, clipped_sq_BT)
        # where the clamp is inactive old + (V - old) may round 1 ulp away from V: not a clipped token
        clipped_BT = (((values_BT - old_values_BT).abs() > clip) & (clipped_sq_BT > unclipped_BT)).float()
    loss = token_mean(per_token_BT, mask_BT, norm)
    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_fraction": metric_mean(clipped_BT, mask_BT, norm),
            "value_mean": metric_mean(values_BT.detach(), mask_BT, norm),
        }
    return loss, metrics
