"""Evaluation metrics over n scored samples per prompt: pure functions of rewards and answers.

A sample is *correct* when its reward is 1 (every built-in benchmark scores 1 or 0: the math
verifier, the code sandbox with all tests passing, IFEval with every instruction followed).

- `pass_at_k`: the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, eq. 1): with n samples
  of which c are correct, 1 - C(n-c, k) / C(n, k), the probability that k samples drawn without
  replacement from the n include a correct one. Computed as their numerically stable product
  1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomials. Averaged over prompts.
  pass@1 is c/n, so the mean pass@1 equals the mean accuracy when every prompt has n samples.
- `maj_at_k`: majority vote over the extracted final answers of each prompt's *first* k samples; the
  prompt scores 1 when the winning answer is correct. Answers are compared as strings with all
  whitespace removed (so `\\frac{1}{2}` and `0.5` are different votes: a cheap, deterministic
  grouping; the verifier's equivalence is used only to judge the winner). Samples without an
  extracted answer do not vote; a prompt where none has one scores 0. Ties go to the answer that
  appears first among the k samples. Defined only for benchmarks with final answers (math); code and
  IFEval responses have nothing to vote on, so evaluation reports maj@k as null there.
- `mean_accuracy`: the mean reward over every sample of every prompt.
"""

from __future__ import annotations

import math
import re

_WHITESPACE = re.compile(r"\s+")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt: 1 - C(n-c, k) / C(n, k) for n samples, c of them correct."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={num_correct}, n={num_samples}")
    if num_samples - num_correct < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def mean_pass_at_k(correct_per_prompt: list[list[bool]], k: int) -> float:
    """pass@k averaged over prompts; `correct_per_prompt[p]` holds prompt p's n >= k verdicts."""
    return sum(pass_at_k(len(correct), sum(correct), k) for correct in correct_per_prompt) / len(correct_per_prompt)


def majority_vote(answers: list[str | None]) -> int | None:
    """The index of the first sample giving the most frequent answer (whitespace ignored; None does not
    vote; ties go to the answer seen first), or None when no sample has an answer."""
    counts: dict[str, int] = {}
    first_index: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        key = _WHITESPACE.sub("", answer)
        counts[key] = counts.get(key, 0) + 1
        first_index.setdefault(key, index)
    if not counts:
        return None
    winner = max(counts, key=lambda key: (counts[key], -first_index[key]))
    return first_index[winner]


def maj_at_k(answers_per_prompt: list[list[str | None]], correct_per_prompt: list[list[bool]], k: int) -> float:
    """maj@k averaged over prompts: the vote of each prompt's first k samples, judged by the winner's verdict."""
    total = 0.0
    for answers, correct in zip(answers_per_prompt, correct_per_prompt, strict=True):
        if len(answers) < k:
            raise ValueError(f"maj@k needs at least k={k} samples per prompt, got {len(answers)}")
        winner = majority_vote(answers[:k])
        total += winner is not None and correct[winner]
    return total / len(answers_per_prompt)


def mean_accuracy(rewards_per_prompt: list[list[float]]) -> float:
    """The mean reward over every sample of every prompt."""
    rewards = [reward for rewards in rewards_per_prompt for reward in rewards]
    return sum(rewards) / len(rewards)
