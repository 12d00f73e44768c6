"""On-policy distillation's two per-token signals, as pure tensor functions (algorithms/distill.py uses them).

Shapes: B sequences, T positions, K token ids per position; `mask_BT` is 1 on the trained (student-sampled)
tokens. Logprobs are the full-vocabulary log-softmax values, 0 off the mask.

1. The sampled-token reverse KL as an advantage (Thinking Machines, "On-Policy Distillation", 2025, and its
   Tinker cookbook; the on-policy, reverse-KL case of GKD, Agarwal et al. 2024, arXiv:2306.13649):
       A_t = log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t)        (detached; discount 0)
   E over y_t ~ pi_student of -A_t is KL(pi_student || pi_teacher) at that position, so a policy gradient
   on A_t descends the per-token reverse KL. It goes through GRPO's clipped surrogate as any advantage.
2. A KL over the teacher's top-k tokens S_t (NeMo-RL's DistillationLossFn, k = 64 in its recipes), with p and q
   the teacher's and the student's distributions on S_t:
       forward_t = sum_{i in S_t} p_i (log p_i - log q_i)
       reverse_t = sum_{i in S_t} q_i (log q_i - log p_i)
       mixed_t   = w forward_t + (1 - w) reverse_t
   With `renormalize` (`distill.topk_renormalize`, the default) p and q are renormalised over S_t, log p_i =
   log pi_teacher(i) - log sum_{j in S_t} pi_teacher(j) and the same for q: NeMo-RL's default
   (`zero_outside_topk=false`, get_distillation_topk_logprobs_from_logits log-softmaxes the k logits of both
   sides), a true KL between two distributions on S_t, so never negative. Without, p and q are the
   full-vocabulary probabilities at the ids of S_t and the mass outside S_t is ignored (reverse_t may then be
   negative); NeMo-RL has no such mode (its `zero_outside_topk=true` keeps the teacher renormalised and adds
   the student's mass outside S_t to the reverse KL). Both equal the exact KL when k is the vocabulary size.
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
    *,
    renormalize: bool,
) -> torch.Tensor:
    """Per-token KL [B, T] restricted to the teacher's top-k ids (the module docstring's formulas); the inputs are
    the student's and the teacher's full-vocabulary logprobs [B, T, K] at the same ids. `renormalize`:
    log-softmax each side over its K logprobs first (the full-vocabulary normaliser cancels, so this is the
    log-softmax of the K logits)."""
    if renormalize:
        student_topk_BTK = torch.log_softmax(student_topk_BTK, dim=-1)
        teacher_topk_BTK = torch.log_softmax(teacher_topk_BTK, dim=-1)
    forward_BT = (teacher_topk_BTK.exp() * (teacher_topk_BTK - student_topk_BTK)).sum(dim=-1)
    if kind == "forward":
        return forward_BT
    reverse_BT = (student_topk_BTK.exp() * (student_topk_BTK - teacher_topk_BTK)).sum(dim=-1)
    if kind == "reverse":
        return reverse_BT
    return mixed_kl_weight * forward_BT + (1.0 - mixed_kl_weight) * reverse_BT
