"""Group-relative advantages (pure tensor functions).

GRPO (Shao et al. 2024, DeepSeekMath) scores each of the G samples of a prompt against its group:
    A_i = (r_i - baseline_i) / (std(r) + eps)      (the division is optional: Dr.GRPO drops it)
Baselines:
    mean:           baseline_i = mean_j r_j
    leave-one-out:  baseline_i = mean_{j != i} r_j = (sum_j r_j - r_i) / (G - 1)   (RLOO, Ahmadian et al. 2024)
A group whose rewards are all equal gets advantage 0 everywhere, so it adds no policy gradient
(DAPO's dynamic sampling drops such groups: `informative_groups`).
`std` is the unbiased (G - 1) sample standard deviation, as in the GRPO reference implementations.
With `valid_PG` (False: an episode masked for an infrastructure failure, rollout/infra.py) every sum, mean,
std and G above runs over the group's valid samples only (n of them), and an invalid sample's advantage is 0;
a group with fewer than two valid samples gets advantage 0 everywhere.

Also here, as pure functions of rewards:
    batch whitening:  A <- (A - mean(A)) / (std(A) + eps) over the whole batch, all groups together, std the
                      population one (as OpenRLHF's and NeMo-RL's REINFORCE++; not PPO's Bessel-corrected one)
                      (REINFORCE++, Hu 2025, arXiv:2501.03262; after a group-mean baseline it is REINFORCE++-baseline):
                      over every valid token (the paper's and its reference implementations': a sequence
                      weighs as many tokens as it trains on), or each sequence once
    GDPO:             each reward component normalised within its group, then the weighted sum whitened
                      over the batch (Liu et al. 2026, arXiv:2601.05242), by the same batch whitening
    overlong penalty: DAPO's "soft overlong punishment" (Yu et al. 2025, arXiv:2503.14476), added to the reward
"""

from __future__ import annotations

from typing import Callable

import torch

Baseline = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rewards [P, G], valid [P, G]) -> [P, G]


def _valid(rewards_PG: torch.Tensor, valid_PG: torch.Tensor | None) -> torch.Tensor:
    """[P, G] float: 1 on the samples that count (all of them when `valid_PG` is None)."""
    return torch.ones_like(rewards_PG) if valid_PG is None else valid_PG.to(rewards_PG.dtype)


def mean_baseline(rewards_PG: torch.Tensor, valid_PG: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of the group's valid samples, broadcast to every sample: [P, G]."""
    valid_PG = _valid(rewards_PG, valid_PG)
    mean_P1 = (rewards_PG * valid_PG).sum(dim=1, keepdim=True) / valid_PG.sum(dim=1, keepdim=True).clamp(min=1)
    return mean_P1.expand_as(rewards_PG)


def leave_one_out_baseline(rewards_PG: torch.Tensor, valid_PG: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of the group's other n - 1 valid samples: [P, G] (0 in a group with fewer than two)."""
    assert rewards_PG.shape[1] >= 2, "leave-one-out needs at least two samples per group"
    valid_PG = _valid(rewards_PG, valid_PG)
    others_P1 = (valid_PG.sum(dim=1, keepdim=True) - 1).clamp(min=1)
    return ((rewards_PG * valid_PG).sum(dim=1, keepdim=True) - rewards_PG * valid_PG) / others_P1


BASELINES: dict[str, Baseline] = {"mean": mean_baseline, "leave_one_out": leave_one_out_baseline}


def group_advantages(
    rewards_PG: torch.Tensor,
    baseline: Baseline,
    normalize_std: bool,
    eps: float = 1e-6,
    valid_PG: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [P, G] for P prompts with G samples each, over the valid ones (`valid_PG`, see the module doc)."""
    if valid_PG is None:
        advantages_PG = rewards_PG - baseline(rewards_PG, None)
        if normalize_std:
            advantages_PG = advantages_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)
        return advantages_PG
    weights_PG = _valid(rewards_PG, valid_PG)
    num_valid_P1 = weights_PG.sum(dim=1, keepdim=True)
    advantages_PG = (rewards_PG - baseline(rewards_PG, valid_PG)) * weights_PG
    if normalize_std:
        mean_P1 = mean_baseline(rewards_PG, valid_PG)[:, :1]
        variance_P1 = (weights_PG * (rewards_PG - mean_P1) ** 2).sum(dim=1, keepdim=True) / (num_valid_P1 - 1).clamp(
            min=1
        )
        advantages_PG = advantages_PG / (variance_P1.sqrt() + eps)
    return advantages_PG * (num_valid_P1 >= 2)


def batch_whiten(
    advantages_PG: torch.Tensor,
    eps: float = 1e-6,
    num_tokens_PG: torch.Tensor | None = None,
    valid_PG: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages normalised by the mean and the population standard deviation of the whole batch [P, G],
    not of each group: REINFORCE++'s global advantage normalisation. With `num_tokens_PG` (each sequence's
    valid tokens) the moments are over the tokens, every token carrying its sequence's advantage:
        mean = sum_i n_i A_i / sum_i n_i,   var = sum_i n_i (A_i - mean)^2 / sum_i n_i,
        A_i <- (A_i - mean) / (sqrt(var) + eps)
    (a sequence with no valid token then counts for nothing); without, over the sequences (n_i = 1); a
    sequence not in `valid_PG` counts for nothing either (n_i = 0).
    OpenRLHF (experience_maker.py, `reinforce_baseline`) and NeMo-RL (ReinforcePlusPlusAdvantageEstimator)
    take the same population variance over the tokens and multiply by rsqrt(max(var, 1e-8)) instead: the same
    up to eps unless the batch is nearly constant (std below about 1e-4)."""
    weights_PG = torch.ones_like(advantages_PG) if num_tokens_PG is None else num_tokens_PG.to(advantages_PG.dtype)
    weights_PG = weights_PG * _valid(advantages_PG, valid_PG)
    total = weights_PG.sum().clamp(min=1)
    mean = (weights_PG * advantages_PG).sum() / total
    std = ((weights_PG * (advantages_PG - mean) ** 2).sum() / total).sqrt()
    return (advantages_PG - mean) / (std + eps)


def decoupled_advantages(
    rewards_KPG: torch.Tensor,
    weights_K: torch.Tensor,
    baseline: Baseline,
    eps: float = 1e-6,
    num_tokens_PG: torch.Tensor | None = None,
    valid_PG: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDPO (Liu et al. 2026, "Group reward-Decoupled Normalization Policy Optimization", arXiv:2601.05242):
    K reward components [K, P, G], each normalised within its group (baseline, then the group's std),
    summed with `weights_K`, then whitened over the batch (`batch_whiten`, by tokens with `num_tokens_PG`):
        A_i = whiten_batch( sum_k w_k (r_k,i - baseline_k,i) / (std_group(r_k) + eps) )
    Normalising the summed reward instead (GRPO) maps different mixes of components to the same advantage
    (one correct answer with bad format = one wrong answer with good format, in a group of two); a component
    equal across its group adds 0. With one component this is GRPO's advantage, whitened.
    The authors' code (NVlabs/GDPO) whitens with the Bessel-corrected std: veRL's masked_whiten over the tokens
    (verl-GDPO) or torch's std + 1e-4 over the sequences (trl-GDPO), as NeMo-RL's GDPOAdvantageEstimator does
    (over the sequences, no eps); here the population std + eps, a factor sqrt(N / (N - 1)) apart for N tokens
    or sequences."""
    summed_PG = sum(
        weight * group_advantages(rewards_PG, baseline, normalize_std=True, eps=eps, valid_PG=valid_PG)
        for weight, rewards_PG in zip(weights_K.tolist(), rewards_KPG)
    )
    whitened_PG = batch_whiten(summed_PG, eps, num_tokens_PG, valid_PG)
    return whitened_PG if valid_PG is None else whitened_PG * valid_PG


def informative_groups(rewards_PG: torch.Tensor, valid_PG: torch.Tensor | None = None) -> torch.Tensor:
    """[P] bool: True for the groups whose (valid) rewards are not all equal (the others have advantage 0)."""
    if valid_PG is None:
        return (rewards_PG != rewards_PG[:, :1]).any(dim=1)
    highest_P = rewards_PG.masked_fill(~valid_PG, -torch.inf).max(dim=1).values
    lowest_P = rewards_PG.masked_fill(~valid_PG, torch.inf).min(dim=1).values
    return highest_P > lowest_P


def overlong_penalty(lengths_B: torch.Tensor, max_length: int, buffer_length: int) -> torch.Tensor:
    """DAPO's soft overlong punishment for responses of `lengths_B` tokens, with L_max = max_length and
    L_cache = buffer_length (> 0):
        R = 0                                  if |y| <= L_max - L_cache
        R = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max   (linear from 0 to -1)
        R = -1                                 if |y| > L_max
    """
    assert buffer_length > 0, "the overlong buffer must be at least one token"
    penalty_B = ((max_length - buffer_length) - lengths_B.float()) / buffer_length
    return penalty_B.clamp(min=-1.0, max=0.0)
