"""What the RL recipes (GRPO, PPO, distillation) share between a step's scored trajectories and their advantages,
owned by none of them: DAPO's overlong reward shaping and filtering (`overlong:`, arXiv:2503.14476), and which
samples count in the group statistics (not those excluded for an infrastructure failure). The tensor math is
advantages.py's."""

from __future__ import annotations

import torch
from pydantic import Field

from reinforge.algorithms.advantages import overlong_penalty
from reinforge.config.section import Section
from reinforge.data.batch import Trajectory


class OverlongConfig(Section):
    """`overlong:` DAPO's treatment of answers that reach the length limit (GRPO and PPO)."""

    buffer_tokens: int = Field(default=0, ge=0)
    """L_cache of DAPO's soft overlong punishment: a reward penalty growing linearly from 0 to -1 over the
    last L_cache tokens before `generation.max_new_tokens` (L_max); single-turn only; 0 disables it."""
    filtering: bool = False
    """DAPO's overlong filtering: truncated answers (no stop before `generation.max_new_tokens`) are masked
    out of the loss; their rewards still count in their group's baseline."""


def check_overlong(overlong: OverlongConfig, max_new_tokens: int, max_turns: int) -> None:
    """The overlong buffer against the length limit it sits under (a root validator calls this)."""
    if overlong.buffer_tokens > max_new_tokens:
        raise ValueError(
            f"overlong.buffer_tokens={overlong.buffer_tokens} must be in [0, generation.max_new_tokens="
            f"{max_new_tokens}]: the buffer is the last tokens before the length limit (0 disables the penalty)"
        )
    if overlong.buffer_tokens and max_turns != 1:
        raise ValueError(
            "overlong.buffer_tokens > 0 needs rollout.max_turns=1: L_max is generation.max_new_tokens, a per-turn "
            "limit, so a multi-turn answer would be punished for its number of turns; set overlong.buffer_tokens=0"
        )


def overlong_penalties(trajectories: list[Trajectory], overlong: OverlongConfig, max_new_tokens: int) -> torch.Tensor:
    """DAPO's soft overlong punishment of each single-turn trajectory [N] on its number of generated tokens
    (zeros when `overlong.buffer_tokens` is 0)."""
    if not overlong.buffer_tokens:
        return torch.zeros(len(trajectories))
    lengths = torch.tensor([len(t.response_ids) for t in trajectories])
    return overlong_penalty(lengths, max_new_tokens, overlong.buffer_tokens)


def valid_samples(trajectories: list[Trajectory], rewards_PG: torch.Tensor) -> torch.Tensor | None:
    """[P, G] bool: False on the samples excluded for an infrastructure failure (or in a dropped group,
    rollout/infra.py), which count in no group statistic; None when none is (every sample counts)."""
    if not any(t.excluded for t in trajectories):
        return None
    return torch.tensor([not t.excluded for t in trajectories]).view_as(rewards_PG)
