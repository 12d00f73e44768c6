"""Train/inference consistency: do the generation engine and the trainer assign the same logprobs to
the same tokens? A mismatch makes "on-policy" training silently off-policy, so the run checks it at
start-up and after the first refit, and logs it every step."""

from __future__ import annotations

import torch

from reinforge.data.batch import TrainBatch, collate
from reinforge.data.prompts import Prompt
from reinforge.errors import ReinforgeError
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.rollout.single_turn import generate_trajectories


class ConsistencyError(ReinforgeError):
    """The engine's logprobs disagree with the trainer's beyond generation.max_logprob_error."""


def mismatch_metrics(batch: TrainBatch) -> dict[str, float]:
    """Per-token agreement of `gen_logprobs` (engine) with `old_logprobs` (trainer) over the loss mask."""
    mask = batch.loss_mask > 0
    log_ratio = (batch.old_logprobs - batch.gen_logprobs)[mask]  # log w_t, w_t = p_train / p_gen
    ratio = torch.exp(log_ratio)
    return {
        "train/token_mult_prob_error": torch.exp(log_ratio.abs()).mean().item(),
        "train/gen_kl_error": (ratio - log_ratio - 1).mean().item(),  # k3 estimate of KL(gen || train)
        "train/is_ratio_mean": ratio.mean().item(),
        "train/is_ratio_min": ratio.min().item(),
        "train/is_ratio_max": ratio.max().item(),
    }


def probe(prompts: list[Prompt], engine: GenerationBackend, trainer, tokenizer, params: SamplingParams) -> float:
    """Sample with the engine, recompute with the trainer, return token_mult_prob_error."""
    trajectories = generate_trajectories(prompts, engine, params, tokenizer)
    batch = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    batch.old_logprobs = trainer.logprobs(batch)
    return mismatch_metrics(batch)["train/token_mult_prob_error"]


def check(error: float, threshold: float, when: str, params: SamplingParams) -> None:
    """Stop the run, naming the likely cause, when the probe's error exceeds the threshold."""
    if error <= threshold:
        return
    if when == "after the first refit":
        cause = ("the engine did not take the new weights: the refit failed or its parameter names do not match "
                 "the engine's model")
    else:
        cause = ("different dtypes or weights on the two sides, or a sampling parameter (temperature, top_p, top_k) "
                 "applied by the engine but not by the trainer")
        if params.top_p < 1 or params.top_k > 0:
            cause = ("generation.top_p/top_k reshape the engine's sampling distribution while the trainer's logprobs "
                     "cover the whole vocabulary; set top_p=1 and top_k=-1, or raise the threshold and use loss.is_correction")
    raise ConsistencyError(
        f"train/inference mismatch {when}: token_mult_prob_error={error:.4f} > generation.max_logprob_error={threshold}; "
        f"likely cause: {cause}"
    )
