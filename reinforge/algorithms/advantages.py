"""Group-relative advantages (pure tensor functions).

GRPO (Shao et al. 2024, DeepSeekMath) scores each of the G samples of a prompt against its group:
    A_i = (r_i - baseline_i) / (std(r) + eps)      (the division is optional: Dr.GRPO drops it)
Baselines:
    mean:           baseline_i = mean_j r_j
    leave-one-out:  baseline_i = mean_{j != i} r_j = (sum_j r_j - r_i) / (G - 1)   (RLOO, Ahmadian et al. 2024)
A group whose rewards are all equal gets advantage 0 everywhere, so it adds no policy gradient.
`std` is the unbiased (G - 1) sample standard deviation, as in the GRPO reference implementations.
"""

from __future__ import annotations

from typing import Callable

import torch

Baseline = Callable[[torch.Tensor], torch.Tensor]


def mean_baseline(rewards_PG: torch.Tensor) -> torch.Tensor:
    """The group mean, broadcast to every sample: [P, G]."""
    return rewards_PG.mean(dim=1, keepdim=True).expand_as(rewards_PG)


def leave_one_out_baseline(rewards_PG: torch.Tensor) -> torch.Tensor:
    """The mean of the other G - 1 samples of the group: [P, G]."""
    num_generations = rewards_PG.shape[1]
    assert num_generations >= 2, "leave-one-out needs at least two samples per group"
    return (rewards_PG.sum(dim=1, keepdim=True) - rewards_PG) / (num_generations - 1)


BASELINES: dict[str, Baseline] = {"mean": mean_baseline, "leave_one_out": leave_one_out_baseline}


def group_advantages(
    rewards_PG: torch.Tensor, baseline: Baseline, normalize_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages [P, G] for P prompts with G samples each."""
    advantages_PG = rewards_PG - baseline(rewards_PG)
    if normalize_std:
        advantages_PG = advantages_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)
    return advantages_PG
