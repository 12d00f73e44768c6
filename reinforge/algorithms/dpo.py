"""DPO from preference pairs: one loop, read top to bottom.

Before training: tokenize the pairs (prompt with the generation prompt, then each reply and its
end-of-turn token: the tokens the policy would generate); compute the reference policy's sequence
logprobs of the held-out pairs, and of the training pairs too with `dpo.reference=precompute`.
Each step: draw a global batch of pairs; their reference logprobs (looked up, or computed now by the
frozen reference); the policy's sequence logprobs of both replies, micro-batch by micro-batch, with
gradients; the DPO loss (plus an optional NLL term on the chosen replies); one AdamW step; validate;
log. At the end, the policy in Hugging Face format.

As implemented, relative to DPO (Rafailov et al. 2023, arXiv:2305.18290):
1. The reference policy is the starting model (the paper's pi_SFT). `dpo.reference=per_batch` (the
   default) keeps a frozen copy that computes each batch's reference logprobs; `precompute` computes
   them for every pair once, with the policy itself before the first update, so no second model is
   kept in memory (the same numbers, up to float rounding in differently padded batches).
2. Optional NLL on the chosen replies, `dpo.sft_weight` x their mean per-token negative log-likelihood
   over the global batch, as in RPO (Pang et al. 2024, arXiv:2404.19733); off by default.
3. A sequence's logprob is the sum over its reply tokens, end-of-turn token included; prompt tokens
   are never trained on. The loss is averaged over the pairs of the global batch.

With `model.lora` only PEFT's LoRA adapters are trained, and the reference is the same model with its
adapters disabled (with either `dpo.reference`: no second model); `final/` holds the adapter in PEFT's
format (training/lora.py).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import model_validator

from reinforge.algorithms.losses import dpo_loss, sequence_logprobs, token_mean
from reinforge.algorithms.pairs import (
    PairRunConfig,
    PairRunResult,
    PairTrainBatch,
    check_schedule,
    chosen_and_rejected,
    evaluate,
    optimizer_step,
    pair_batch,
    with_prefix,
)
from reinforge.config.loader import save_config
from reinforge.config.section import Section
from reinforge.data.batch import Normalisers
from reinforge.data.preference import TokenizedPair, load_pairs, tokenize_for_policy
from reinforge.data.prompts import PromptSampler
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import LoggingConfig
from reinforge.logging.metrics import JsonlWriter, Timers
from reinforge.loops.builders import build_recipe_backend
from reinforge.modeling import check_fits_context, load_processor, load_tokenizer, save_tokenizer
from reinforge.run_dir import atomic_directory, make_run_dir
from reinforge.training.heads import LogprobHead
from reinforge.training.lora import check_lora


class DPOConfig(Section):
    beta: float = 0.1
    """beta of DPO: implicit rewards are beta * (log pi - log pi_ref) of each reply; a larger beta holds
    the policy closer to the reference."""
    sft_weight: float = 0.0
    """Weight of the chosen replies' mean per-token negative log-likelihood added to the loss (RPO); 0: plain DPO."""
    reference: Literal["per_batch", "precompute"] = "per_batch"
    """`per_batch`: a frozen copy of the starting model computes each batch's reference logprobs;
    `precompute`: the starting policy computes them for every training pair once, before the first
    update, so no second model is kept in memory (worth it from about one epoch of training on). With
    `model.lora` neither keeps a copy: the reference is the policy with its adapters disabled."""
    max_steps: int = 100
    """Optimizer steps; each takes training.global_batch_size / 2 pairs, the data recycled epoch after epoch."""
    val_every: int = 10
    """Validate on the held-out pairs every this many steps (and before the first and after the last); 0: only then."""


class DPORunConfig(PairRunConfig):
    """A whole `reinforge dpo` run."""

    recipe: ClassVar[str] = "dpo"

    dpo: DPOConfig = DPOConfig()
    """The DPO objective and schedule."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/dpo")
    """Run directory (config.yaml, metrics.jsonl, final/) and console output."""

    @model_validator(mode="after")
    def _check_dpo(self) -> "DPORunConfig":
        check_schedule(self.dpo.max_steps, self.dpo.val_every, "dpo")
        if self.dpo.beta <= 0:
            raise ValueError("dpo.beta must be > 0 (typical values 0.01 to 0.5)")
        if self.dpo.sft_weight < 0:
            raise ValueError("dpo.sft_weight must be >= 0 (0 disables the NLL term)")
        return self


def train(config: DPORunConfig) -> PairRunResult:
    with ExitStack() as cleanup:  # the FSDP2 ranks and Ray, on every way out
        return run(config, cleanup)


def run(config: DPORunConfig, cleanup: ExitStack) -> PairRunResult:
    dpo, training = config.dpo, config.training
    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    tokenizer = load_tokenizer(config.model)
    check_fits_context(config.model, config.data.max_length, f"data.max_length={config.data.max_length}")
    pad_id = tokenizer.pad_token_id
    processor = load_processor(config.model)  # a vision-language model's: pairs may hold images
    train_pairs = load_pairs(config.data.train_path, tokenizer, tokenize_for_policy, config.data, processor)
    val_pairs = (
        load_pairs(config.data.val_path, tokenizer, tokenize_for_policy, config.data, processor, val=True)[
            : config.data.max_val_pairs
        ]
        if config.data.val_path
        else []
    )
    run_dir = make_run_dir(config.logging.run_dir)
    save_config(
        config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": str(run_dir)})}),
        run_dir / "config.yaml",
    )

    # per_batch keeps a frozen copy; with LoRA the policy with its adapters disabled is the reference
    backend = build_recipe_backend(
        config,
        dpo.max_steps,
        LogprobHead(temperature=1.0),
        cleanup,
        rows_together=2,  # a pair's chosen and rejected rows
        load_reference=dpo.reference == "per_batch",
    )
    # the frozen copy, else the policy: adapters off, or (precompute) not yet updated
    use_reference = dpo.reference == "per_batch" or config.model.lora is not None

    def dpo_batch(pairs: list[TokenizedPair], reference_B: torch.Tensor | None = None) -> DPOBatch:
        return pair_batch(pairs, pad_id, batch_type=DPOBatch, reference_B=reference_B)

    def reference_logprobs(pairs: list[TokenizedPair]) -> torch.Tensor:
        """Sequence logprobs [2N] of the pairs' replies (chosen 0, rejected 0, ...) under the reference."""
        if not pairs:
            return torch.zeros(0)
        batch = dpo_batch(pairs)
        return sequence_logprobs(backend.per_token(batch, reference=use_reference), batch.loss_mask)

    timers = Timers()
    with timers.time("reference"):
        val_ref_B = reference_logprobs(val_pairs)
        train_ref_N2 = reference_logprobs(train_pairs).view(-1, 2) if dpo.reference == "precompute" else None
    val_batch = dpo_batch(val_pairs, val_ref_B) if val_pairs else None
    pairs_per_step = training.global_batch_size // 2
    sampler = PromptSampler(
        list(range(len(train_pairs))), pairs_per_step, config.seed, config.data.shuffle
    )  # draws pair indices
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    first_val, last_val = {}, {}

    def validate() -> dict[str, float]:
        return evaluate(backend, val_batch, make_loss_fn(val_pairs, dpo))

    with ConsoleLog(dpo.max_steps, "DPO") as console:
        console.print(f"run directory: {run_dir}   {len(train_pairs)} train / {len(val_pairs)} val pairs")
        if val_pairs:
            first_val = last_val = validate()
            metrics_log.write(0, {**first_val, **timers.metrics()})
            console.print(val_line(0, first_val))

        for step in range(1, dpo.max_steps + 1):
            timers = Timers()
            with timers.time("step"):
                indices = sampler.next_batch()
                pairs = [train_pairs[i] for i in indices]
                with timers.time("reference"):
                    ref_B = train_ref_N2[indices].flatten() if train_ref_N2 is not None else reference_logprobs(pairs)
                with timers.time("train"):
                    updates = optimizer_step(backend, dpo_batch(pairs, ref_B), make_loss_fn(pairs, dpo))
            metrics = {**with_prefix("train", updates), "train/epoch": step * pairs_per_step / len(train_pairs)}
            if val_pairs and (step == dpo.max_steps or (dpo.val_every and step % dpo.val_every == 0)):
                with timers.time("val"):
                    last_val = validate()
                metrics.update(last_val)
            metrics.update(timers.metrics())
            metrics["perf/tokens_per_s"] = (
                sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs) / timers.seconds["step"]
            )
            metrics_log.write(step, metrics)
            console.step(step, metrics, show_line=step % config.logging.console_every == 0)
            if "val/loss" in metrics:
                console.print(val_line(step, metrics))

        if config.checkpoint.save_final:
            with atomic_directory(run_dir / "final") as tmp:
                backend.save_pretrained(tmp)  # with LoRA, the adapter in PEFT's format
                save_tokenizer(config.model, tmp)

    if first_val:
        for name in ("reward_margin", "preference_accuracy", "logp_accuracy"):
            console.print(
                f"val/{name}: {first_val[f'val/{name}']:.3f} at step 0 -> "
                f"{last_val[f'val/{name}']:.3f} at step {dpo.max_steps}"
            )
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}"
        + (f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else "")
    )
    return PairRunResult(run_dir=run_dir, first_val=first_val, last_val=last_val)


@dataclass
class DPOBatch(PairTrainBatch):
    """Pairs with the reference policy's sequence logprob of each of their sequences."""

    reference_B: torch.Tensor | None = None  # [B]: log pi_ref of each sequence's reply


def make_loss_fn(pairs: list[TokenizedPair], d: DPOConfig):
    """The DPO (+ NLL) loss of a micro-batch of a global batch of `pairs`, over the policy's per-token logprobs."""
    num_chosen_tokens = sum(len(p.chosen_ids) - p.num_prompt_tokens for p in pairs)  # the NLL term's normaliser

    def loss_fn(logprobs_BT: torch.Tensor, micro: DPOBatch, norm: Normalisers):
        num_pairs = norm.num_sequences // 2
        chosen_P, rejected_P, _ = chosen_and_rejected(sequence_logprobs(logprobs_BT, micro.loss_mask), micro)
        ref_chosen_P, ref_rejected_P, _ = chosen_and_rejected(micro.reference_B, micro)
        loss, metrics = dpo_loss(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P, num_pairs, beta=d.beta)
        chosen_mask_BT = micro.loss_mask * micro.chosen.unsqueeze(1)
        sft = token_mean(
            -logprobs_BT, chosen_mask_BT, Normalisers(num_tokens=num_chosen_tokens, num_sequences=num_pairs)
        )
        with torch.no_grad():
            margin_P = chosen_P - rejected_P
            metrics["logp_accuracy"] = ((margin_P > 0).float() + 0.5 * (margin_P == 0).float()).sum() / num_pairs
        metrics.update(dpo_loss=metrics["loss"], sft_loss=sft.detach())
        if d.sft_weight > 0:
            loss = loss + d.sft_weight * sft
            metrics["loss"] = loss.detach()
        return loss, metrics

    return loss_fn


def val_line(step: int, metrics: dict[str, float]) -> str:
    return (
        f"step {step:>4} | val loss {metrics['val/loss']:.4f} | margin {metrics['val/reward_margin']:+.3f} | "
        f"pref_acc {metrics['val/preference_accuracy']:.3f} | logp_acc {metrics['val/logp_accuracy']:.3f}"
    )
