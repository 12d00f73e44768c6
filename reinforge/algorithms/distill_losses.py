"""On-policy distillation's two per-token signals, as pure tensor functions (algorithms/distill.py uses them).

Shapes: B sequences, T positions, K token ids per position; `mask_BT` is 1 on the trained (student-sampled)
tokens. Logprobs are the full-vocabulary log-softmax values, 0 off the mask.

1. The sampled-token reverse KL as an advantage (Thinking Machines, "On-Policy Distillation", 2025, and its
   Tinker cookbook; the on-policy, reverse-KL case of GKD, Agarwal et al. 2024, arXiv:2306.13649):
       A_t = log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t)        (detached; discount 0)
   E over y_t ~ pi_student of -A_t is KL(pi_student || pi_teacher) at that position, so a policy gradient
   on A_t descends the per-token reverse KL. It goes through GRPO's clipped surrogate as any advantage.
2. A KL over the teacher's top-k tokens S_t (NeMo-RL's DistillationLossFn, k = 64 there), with
   p = pi_teacher and q = pi_student at the ids in S_t (full-vocabulary probabilities, not renormalised):
       forward_t = sum_{i in S_t} p_i (log p_i - log q_i)
       reverse_t = sum_{i in S_t} q_i (log q_i - log p_i)
       mixed_t   = w forward_t + (1 - w) reverse_t
   Differentiated directly (no sampling): the student's whole distribution on S_t moves toward the teacher's.
"""

from __future__ import annotations

from typing import Literal

import torch


def reverse_kl_advantages(
    teacher_logprobs_BT: torch.Tensor, student_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """A_t = log pi_teacher(y_t) - log pi_student(y_t) on the mask, 0 off it, without gradient [B, T]."""
    return ((teacher_logprobs_BT - student_logprobs_BT) * mask_BT).detach()


def topk_kl(
    student_topk_BTK: torch.Tensor,
    teacher_topk_BTK: torch.Tensor,
    kind: Literal["forward", "reverse", "mixed"],
    mixed_kl_weight: float = 0.5,
) -> torch.Tensor:
    """Per-token KL [B, T] restricted to the teacher's top-k ids (the module docstring's formulas); the inputs are
    the student's and the teacher's logprobs [B, T, K] at the same ids."""
    forward_BT = (teacher_topk_BTK.exp() * (teacher_topk_BTK - student_topk_BTK)).sum(dim=-1)
    if kind == "forward":
        return forward_BT
    reverse_BT = (student_topk_BTK.exp() * (student_topk_BTK - teacher_topk_BTK)).sum(dim=-1)
    if kind == "reverse":
        return reverse_BT
    return mixed_kl_weight * forward_BT + (1.0 - mixed_kl_weight) * reverse_BT
