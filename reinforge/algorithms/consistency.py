"""Train/inference consistency: do the generation engine and the trainer assign the same logprobs to
the same tokens? A mismatch makes "on-policy" training silently off-policy, so the run checks it at
start-up and after the first refit, and logs it every step."""

from __future__ import annotations

from dataclasses import replace

import torch

from reinforge.algorithms.losses import metric_mean
from reinforge.data.batch import Normalisers, TrainBatch, collate, sampled_by
from reinforge.data.prompts import Prompt
from reinforge.errors import ReinforgeError
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.model_config import ModelConfig
from reinforge.modeling import shortest_window
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


def mismatch_metrics(
    batch: TrainBatch, mask_BT: torch.Tensor | None = None, prefix: str = "train/"
) -> dict[str, float]:
    """`mismatch_contributions` of a whole batch (over `mask_BT`, default its loss mask) with `old_logprobs` as the
    trainer's, as `{prefix}*` metrics."""
    mask_BT = batch.loss_mask if mask_BT is None else mask_BT
    norm = Normalisers(num_tokens=int(mask_BT.sum()), num_sequences=len(batch))
    contributions = mismatch_contributions(batch.old_logprobs, batch.gen_logprobs, mask_BT, norm)
    return {f"{prefix}{name}": value.item() for name, value in contributions.items()}


def version_matched_mismatch(
    batch: TrainBatch, trajectories: list, version: int, trainer=None, kept: list[int] = ()
) -> dict[str, float]:
    """The mismatch over the trained tokens, each compared with the weights of the policy version that sampled it:
    `batch.old_logprobs` are policy `version`'s; the `trainer`, under the versions it `kept` (`keep_version`,
    rollout.version_check), gives the other tokens' logprobs, one pass per version. (In async and
    in-flight runs `train/token_mult_prob_error` compares every token with the current policy, so it also counts
    how far the policy moved since an older version sampled it.) `train/version_matched/token_share`: the share of
    trained tokens compared; with none, only that share."""
    width = batch.loss_mask.shape[1]
    matched_BT = batch.loss_mask * sampled_by(trajectories, version, width)
    logprobs_BT = batch.old_logprobs * matched_BT
    for older in [v for v in kept if v != version]:
        mask_BT = batch.loss_mask * sampled_by(trajectories, older, width)
        rows = [row for row in range(len(batch)) if mask_BT[row].any()]
        if not rows:
            continue
        part = batch.select(rows)
        part.loss_mask = mask_BT[rows, : part.loss_mask.shape[1]]
        logprobs_BT[rows, : part.loss_mask.shape[1]] += trainer.logprobs(part, version=older) * part.loss_mask
        matched_BT[rows, : part.loss_mask.shape[1]] += part.loss_mask
    share = {"train/version_matched/token_share": float(matched_BT.sum()) / max(batch.num_valid_tokens(), 1)}
    if not matched_BT.any():
        return share
    matched = mismatch_metrics(replace(batch, old_logprobs=logprobs_BT), matched_BT, prefix="train/version_matched/")
    return share | {name: value for name, value in matched.items() if "is_ratio" not in name}


def probe(
    prompts: list[Prompt],
    engine: GenerationBackend,
    trainer,
    tokenizer,
    params: SamplingParams,
    min_tokens: int = 0,
) -> float:
    """Sample with the engine, recompute with the trainer, return token_mult_prob_error; each prompt at least
    `min_tokens` long (`lengthened`)."""
    trajectories = generate_trajectories(lengthened(prompts, min_tokens), engine, params, tokenizer)
    batch = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    batch.old_logprobs = trainer.logprobs(batch)
    return mismatch_metrics(batch)["train/token_mult_prob_error"]


def probe_tokens(model: ModelConfig, max_prompt_tokens: int) -> int:
    """How long the probe's prompts must be so that every sampled token attends past the model's shortest sliding
    window (`modeling.shortest_window`): window + 1 tokens, as far as `data.max_prompt_tokens` allows (past it the
    run's own prompts never reach the window either, but its answers may); 0 for a model without windows. A layout
    that ignored a window would then give other logprobs than the engine on every token, and fail the probe."""
    window = shortest_window(model)
    return 0 if window is None else min(window + 1, max_prompt_tokens)


def lengthened(prompts: list[Prompt], min_tokens: int) -> list[Prompt]:
    """The prompts, each text prompt shorter than `min_tokens` tokens led by the probe prompts' tokens (in turn, as
    many as it lacks): the engine and the trainer see the same tokens, so any tokens serve the comparison."""
    filler = [token for prompt in prompts for token in prompt.token_ids]
    longer = []
    for prompt in prompts:
        lacking = min_tokens - len(prompt.token_ids)
        if lacking <= 0 or prompt.images is not None or not filler:
            longer.append(prompt)
            continue
        lead = (filler * (lacking // len(filler) + 1))[-lacking:]
        longer.append(replace(prompt, token_ids=lead + list(prompt.token_ids)))
    return longer


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
