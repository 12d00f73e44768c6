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

from typing import Literal

import torch
from pydantic import model_validator

from reinforge.algorithms.losses import Normalisers, dpo_loss, sequence_logprobs, token_mean
from reinforge.algorithms.pairs import (
    PairRunConfig,
    PairRunResult,
    check_schedule,
    evaluate,
    optimizer_step,
    with_prefix,
)
from reinforge.config.loader import save_config
from reinforge.config.schema import LoggingConfig
from reinforge.config.section import Section
from reinforge.data.preference import PairBatch, TokenizedPair, collate_pairs, load_pairs, tokenize_for_policy
from reinforge.data.prompts import PromptSampler
from reinforge.logging.console import ConsoleLog
from reinforge.logging.metrics import JsonlWriter, Timers
from reinforge.modeling import enable_activation_checkpointing, load_model, load_tokenizer
from reinforge.run_dir import atomic_directory, make_run_dir
from reinforge.training.lora import adapter_disabled, check_lora, load_policy
from reinforge.training.torch_backend import build_optimizer, token_logprobs


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
    d, t = config.dpo, config.training
    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    tokenizer = load_tokenizer(config.model)
    pad_id = tokenizer.pad_token_id
    train_pairs = load_pairs(config.data.train_path, tokenizer, tokenize_for_policy, config.data)
    val_pairs = (
        load_pairs(config.data.val_path, tokenizer, tokenize_for_policy, config.data)[: config.data.max_val_pairs]
        if config.data.val_path
        else []
    )
    run_dir = make_run_dir(config.logging.run_dir)
    save_config(
        config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": str(run_dir)})}),
        run_dir / "config.yaml",
    )

    policy, peft_model = load_policy(config.model)
    policy.train()
    if t.activation_checkpointing:
        enable_activation_checkpointing(policy)
    # per_batch's frozen copy; with LoRA the policy with its adapters disabled is the reference
    reference = (
        load_model(config.model).eval().requires_grad_(False)
        if d.reference == "per_batch" and peft_model is None
        else None
    )

    def reference_logprobs(pairs: list[TokenizedPair]) -> torch.Tensor:
        with adapter_disabled(
            peft_model
        ):  # the frozen copy, else the policy: adapters off, or (precompute) not yet updated
            return reply_logprobs(reference or policy, pairs, t.micro_batch_size, pad_id)

    timers = Timers()
    with timers.time("reference"):
        val_ref_N2 = reference_logprobs(val_pairs)
        train_ref_N2 = reference_logprobs(train_pairs) if d.reference == "precompute" else None
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    optimizer, scheduler = build_optimizer(trainable, t, d.max_steps)
    pairs_per_step = t.global_batch_size // 2
    sampler = PromptSampler(
        list(range(len(train_pairs))), pairs_per_step, config.seed, config.data.shuffle
    )  # draws pair indices
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    first_val, last_val = {}, {}

    def validate() -> dict[str, float]:
        return evaluate(
            policy, val_pairs, make_micro_loss(policy, val_pairs, val_ref_N2, d), t.micro_batch_size, pad_id
        )

    with ConsoleLog(d.max_steps, "DPO") as console:
        console.print(f"run directory: {run_dir}   {len(train_pairs)} train / {len(val_pairs)} val pairs")
        if val_pairs:
            first_val = last_val = validate()
            metrics_log.write(0, {**first_val, **timers.metrics()})
            console.print(val_line(0, first_val))

        for step in range(1, d.max_steps + 1):
            timers = Timers()
            with timers.time("step"):
                indices = sampler.next_batch()
                pairs = [train_pairs[i] for i in indices]
                with timers.time("reference"):
                    ref_B2 = train_ref_N2[indices] if train_ref_N2 is not None else reference_logprobs(pairs)
                with timers.time("train"):
                    updates = optimizer_step(
                        policy, optimizer, scheduler, pairs, make_micro_loss(policy, pairs, ref_B2, d), t, pad_id
                    )
            metrics = {**with_prefix("train", updates), "train/epoch": step * pairs_per_step / len(train_pairs)}
            if val_pairs and (step == d.max_steps or (d.val_every and step % d.val_every == 0)):
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
                (peft_model or policy).save_pretrained(tmp)  # with LoRA, the adapter in PEFT's format
                tokenizer.save_pretrained(tmp)

    if first_val:
        for name in ("reward_margin", "preference_accuracy", "logp_accuracy"):
            console.print(
                f"val/{name}: {first_val[f'val/{name}']:.3f} at step 0 -> {last_val[f'val/{name}']:.3f} at step {d.max_steps}"
            )
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}"
        + (f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else "")
    )
    return PairRunResult(run_dir=run_dir, first_val=first_val, last_val=last_val)


def make_micro_loss(policy: torch.nn.Module, pairs: list[TokenizedPair], ref_N2: torch.Tensor, d: DPOConfig):
    """The DPO (+ NLL) loss of a micro-batch of `pairs`, whose reference logprobs are `ref_N2` [N, 2]."""
    num_chosen_tokens = sum(len(p.chosen_ids) - p.num_prompt_tokens for p in pairs)  # the NLL term's normaliser

    def micro_loss(batch: PairBatch, rows: slice, num_pairs: int):
        num = len(batch)
        logprobs_BT = token_logprobs(policy_logits(policy, batch), batch.input_ids, temperature=1.0)
        logps_B = sequence_logprobs(logprobs_BT, batch.loss_mask)
        ref_chosen_B, ref_rejected_B = ref_N2[rows, 0], ref_N2[rows, 1]
        loss, metrics = dpo_loss(logps_B[:num], logps_B[num:], ref_chosen_B, ref_rejected_B, num_pairs, beta=d.beta)
        sft = token_mean(
            -logprobs_BT[:num],
            batch.loss_mask[:num],
            Normalisers(num_tokens=num_chosen_tokens, num_sequences=num_pairs),
        )
        with torch.no_grad():
            margin_B = logps_B[:num] - logps_B[num:]
            metrics["logp_accuracy"] = ((margin_B > 0).float() + 0.5 * (margin_B == 0).float()).sum() / num_pairs
        metrics.update(dpo_loss=metrics["loss"], sft_loss=sft.detach())
        if d.sft_weight > 0:
            loss = loss + d.sft_weight * sft
            metrics["loss"] = loss.detach()
        return loss, metrics

    return micro_loss


def policy_logits(model: torch.nn.Module, batch: PairBatch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits


@torch.no_grad()
def reply_logprobs(
    model: torch.nn.Module, pairs: list[TokenizedPair], micro_batch_size: int, pad_token_id: int
) -> torch.Tensor:
    """Sequence logprobs [N, 2] (chosen, rejected) of each pair's replies under `model`."""
    out = torch.zeros(len(pairs), 2)
    size = micro_batch_size // 2
    for start in range(0, len(pairs), size):
        batch = collate_pairs(pairs[start : start + size], pad_token_id)
        logps_B = sequence_logprobs(
            token_logprobs(policy_logits(model, batch), batch.input_ids, temperature=1.0), batch.loss_mask
        )
        out[start : start + len(batch)] = logps_B.view(2, -1).T
    return out


def val_line(step: int, metrics: dict[str, float]) -> str:
    return (
        f"step {step:>4} | val loss {metrics['val/loss']:.4f} | margin {metrics['val/reward_margin']:+.3f} | "
        f"pref_acc {metrics['val/preference_accuracy']:.3f} | logp_acc {metrics['val/logp_accuracy']:.3f}"
    )
