"""Train/inference consistency: do the generation engine and the trainer assign the same logprobs to
the same tokens? A mismatch makes "on-policy" training silently off-policy, so the run checks it at
start-up and after the first refit, and logs it every step."""

from __future__ import annotations

import torch

from reinforge.algorithms.losses import metric_mean
from reinforge.data.batch import Normalisers, TrainBatch, collate
from reinforge.data.prompts import Prompt
from reinforge.errors import ReinforgeError
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.rollout.single_turn import generate_trajectories


class ConsistencyError(ReinforgeError):
    """The engine's logprobs disagree with the trainer's beyond generation.max_logprob_error."""


def mismatch_contributions(
    train_logprobs_BT: torch.Tensor, gen_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, norm: Normalisers
) -> dict[str, torch.Tensor]:
    """Per-token agreement of the engine's logprobs with the trainer's over `mask_BT`, as contributions
    that sum over micro-batches like a loss's (means divide by `norm.metric_tokens`; `*_min`/`*_max`
    reduce by min/max): token_mult_prob_error = mean exp|log w_t|, gen_kl_error = the k3 estimate of
    KL(gen || train), is_ratio_* of w_t = p_train / p_gen."""
    valid = mask_BT > 0
    log_ratio_BT = (train_logprobs_BT.detach() - gen_logprobs_BT) * valid
    ratio_BT = torch.exp(log_ratio_BT)
    return {
        "token_mult_prob_error": metric_mean(torch.exp(log_ratio_BT.abs()), mask_BT, norm),
        "gen_kl_error": metric_mean(ratio_BT - log_ratio_BT - 1, mask_BT, norm),
        "is_ratio_mean": metric_mean(ratio_BT, mask_BT, norm),
        "is_ratio_min": ratio_BT[valid].min() if valid.any() else ratio_BT.new_tensor(1.0),
        "is_ratio_max": ratio_BT[valid].max() if valid.any() else ratio_BT.new_tensor(1.0),
    }


def mismatch_metrics(batch: TrainBatch) -> dict[str, float]:
    """`mismatch_contributions` of a whole batch with `old_logprobs` as the trainer's, as `train/*` metrics."""
    norm = Normalisers(num_tokens=batch.num_valid_tokens(), num_sequences=len(batch))
    contributions = mismatch_contributions(batch.old_logprobs, batch.gen_logprobs, batch.loss_mask, norm)
    return {f"train/{name}": value.item() for name, value in contributions.items()}


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
        cause = (
            "the engine did not take the new weights: the refit failed or its parameter names do not match "
            "the engine's model"
        )
    else:
        cause = (
            "different dtypes or weights on the two sides, or a sampling parameter (temperature, top_p, top_k) "
            "applied by the engine but not by the trainer"
        )
        if params.top_p < 1 or params.top_k > 0:
            cause = (
                "generation.top_p/top_k reshape the engine's sampling distribution while the trainer's "
                "logprobs cover the whole vocabulary; set top_p=1 and top_k=-1, or raise the threshold and use "
                "loss.is_correction"
            )
    raise ConsistencyError(
        f"train/inference mismatch {when}: token_mult_prob_error={error:.4f} > "
        f"generation.max_logprob_error={threshold}; likely cause: {cause}"
    )
