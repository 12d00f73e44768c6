"""A Bradley-Terry reward model from preference pairs: one loop, read top to bottom.

The model is the causal LM of `model.name_or_path` with its LM head replaced by a freshly initialised
scalar head (transformers' `AutoModelForSequenceClassification`, `num_labels=1`); the reward of a
conversation is the head's output at its last non-pad token. Each step: draw a global batch of pairs;
render both conversations of each with the chat template (exactly as `RewardModelScorer` does when
serving the model); rewards of chosen and rejected, micro-batch by micro-batch; the Bradley-Terry
loss -log sigmoid(r_chosen - r_rejected); one AdamW step; validate (held-out pair accuracy); log. At
the end the model and its tokenizer are saved in Hugging Face format, ready for
`python -m reinforge.envs.reward_model_server RUN_DIR/final` or the judge environment's `local` mode.

As implemented, relative to the reward model of InstructGPT (Ouyang et al. 2022, arXiv:2203.02155):
one pair per prompt rather than all K-choose-2 comparisons of K ranked answers, and no reward
normalisation after training (GRPO's group-normalised advantages do not need it; the judge's
`reward_model_transform: sigmoid` maps scores into (0, 1) where a bounded reward is wanted).

With `model.lora` the body gets PEFT's LoRA adapters and the new scalar head is trained whole (PEFT's
`modules_to_save` for a sequence classifier): those are the only parameters in AdamW. `final/` then holds
the adapter and the head in PEFT's format, which `RewardModelScorer` (the judge's local mode and the
reward-model server) merges onto the base when it loads it.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import ClassVar

import torch
from pydantic import model_validator
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from reinforge.algorithms.losses import bradley_terry_loss
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
from reinforge.data.preference import load_pairs, tokenize_for_reward_model
from reinforge.data.prompts import PromptSampler
from reinforge.errors import ReinforgeError
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import LoggingConfig
from reinforge.logging.metrics import JsonlWriter, Timers
from reinforge.loops.builders import build_recipe_backend
from reinforge.model_config import ModelConfig
from reinforge.modeling import DTYPES, adapter_base, check_fits_context, load_tokenizer, model_location, save_tokenizer
from reinforge.run_dir import atomic_directory, make_run_dir
from reinforge.training.heads import ScalarHead
from reinforge.training.lora import absolute_location, add_lora, check_lora, inner_model


class RewardModelTrainingConfig(Section):
    max_steps: int = 200
    """Optimizer steps; each takes training.global_batch_size / 2 pairs, the data recycled epoch after epoch."""
    val_every: int = 20
    """Validate on the held-out pairs every this many steps (and before the first and after the last); 0: only then."""


class RMRunConfig(PairRunConfig):
    """A whole `reinforge rm` run."""

    recipe: ClassVar[str] = "rm"

    rm: RewardModelTrainingConfig = RewardModelTrainingConfig()
    """The reward-model schedule."""
    logging: LoggingConfig = LoggingConfig(run_dir="runs/rm")
    """Run directory (config.yaml, metrics.jsonl, final/) and console output."""

    @model_validator(mode="after")
    def _check_rm(self) -> "RMRunConfig":
        check_schedule(self.rm.max_steps, self.rm.val_every, "rm")
        if self.model.lora and self.training.backend == "fsdp2":  # FSDP2's adapter export keeps `.lora_` keys only
            raise ValueError(
                "model.lora with training.backend=fsdp2 is not supported by rm yet (the ranks' adapter export leaves "
                "out the new score head); set training.backend=torch or model.lora=null"
            )
        return self


def train(config: RMRunConfig) -> PairRunResult:
    with ExitStack() as cleanup:  # the FSDP2 ranks and Ray, on every way out
        return run(config, cleanup)


def run(config: RMRunConfig, cleanup: ExitStack) -> PairRunResult:
    rm, training = config.rm, config.training
    torch.manual_seed(config.seed)  # also seeds the new scalar head (FSDP2 ranks seed themselves the same way)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    tokenizer = load_tokenizer(config.model)
    check_fits_context(config.model, config.data.max_length, f"data.max_length={config.data.max_length}")
    pad_id = tokenizer.pad_token_id
    train_pairs = load_pairs(config.data.train_path, tokenizer, tokenize_for_reward_model, config.data)
    val_pairs = (
        load_pairs(config.data.val_path, tokenizer, tokenize_for_reward_model, config.data, val=True)[
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

    # the reward of a conversation: the scalar head on its last token's hidden state
    head = ScalarHead(
        "score", from_previous_token=False, load_model=partial(load_scorer, pad_token_id=pad_id), causal_lm=False
    )
    backend = build_recipe_backend(config, rm.max_steps, head, cleanup, rows_together=2)  # a pair's two rows
    pairs_per_step = training.global_batch_size // 2
    sampler = PromptSampler(train_pairs, pairs_per_step, config.seed, config.data.shuffle)  # draws pairs
    val_batch = pair_batch(val_pairs, pad_id, last_token_only=True) if val_pairs else None
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    first_val, last_val = {}, {}

    with ConsoleLog(rm.max_steps, "RM") as console:
        console.print(f"run directory: {run_dir}   {len(train_pairs)} train / {len(val_pairs)} val pairs")
        if val_pairs:
            first_val = last_val = evaluate(backend, val_batch, rm_loss)
            metrics_log.write(0, first_val)
            console.print(val_line(0, first_val))

        for step in range(1, rm.max_steps + 1):
            timers = Timers()
            with timers.time("step"):
                pairs = sampler.next_batch()
                updates = optimizer_step(backend, pair_batch(pairs, pad_id, last_token_only=True), rm_loss)
            metrics = {**with_prefix("train", updates), "train/epoch": step * pairs_per_step / len(train_pairs)}
            if val_pairs and (step == rm.max_steps or (rm.val_every and step % rm.val_every == 0)):
                with timers.time("val"):
                    last_val = evaluate(backend, val_batch, rm_loss)
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
                backend.save_pretrained(tmp)  # with LoRA, the adapter and the head in PEFT's format
                save_tokenizer(config.model, tmp)

    if first_val:
        for name in ("preference_accuracy", "reward_margin"):
            console.print(
                f"val/{name}: {first_val[f'val/{name}']:.3f} at step 0 -> "
                f"{last_val[f'val/{name}']:.3f} at step {rm.max_steps}"
            )
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}"
        + (f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else "")
    )
    return PairRunResult(run_dir=run_dir, first_val=first_val, last_val=last_val)


def load_reward_model(config: ModelConfig, pad_token_id: int) -> PreTrainedModel:
    """The causal LM's body (with `model.adapter` merged in) under a new one-output head; the pad id tells the
    pooling where each sequence ends."""
    location = model_location(config)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            location, num_labels=1, dtype=DTYPES[config.dtype], trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError) as exc:  # ValueError: an architecture without a sequence-classification head
        raise ReinforgeError(
            f"model.name_or_path={config.name_or_path}: could not load it as a reward model "
            f"({str(exc).strip().splitlines()[0]})"
        ) from None
    model.config.pad_token_id = pad_token_id
    if config.adapter:  # a LoRA policy's adapter: its keys name the body's modules, which the classifier shares
        from peft import PeftConfig, PeftModel

        path = adapter_base(config)
        adapter_config = PeftConfig.from_pretrained(path)
        adapter_config.task_type = (
            None  # PEFT's causal-LM wrapper needs an LM head; the plain one merges the body's layers
        )
        model = PeftModel.from_pretrained(model, path, config=adapter_config).merge_and_unload()
    return model


def load_scorer(model_config: ModelConfig, pad_token_id: int):
    """The reward model to train and its PeftModel (with `model.lora`: the body's adapters and the whole new head)."""
    model = load_reward_model(model_config, pad_token_id)
    peft_model = (
        add_lora(model, model_config.lora, absolute_location(model_config), task_type="SEQ_CLS")
        if model_config.lora
        else None
    )
    return inner_model(peft_model or model), peft_model


def rm_loss(rewards_BT: torch.Tensor, micro: PairTrainBatch, norm: Normalisers):
    """The Bradley-Terry loss of a micro-batch: each sequence's reward is the head at its last token (its one
    loss-mask position), averaged over the global batch's pairs."""
    chosen_P, rejected_P, _ = chosen_and_rejected(rewards_BT.sum(dim=1), micro)
    return bradley_terry_loss(chosen_P, rejected_P, norm.num_sequences // 2)


def val_line(step: int, metrics: dict[str, float]) -> str:
    return (
        f"step {step:>4} | val loss {metrics['val/loss']:.4f} | accuracy {metrics['val/preference_accuracy']:.3f} | "
        f"margin {metrics['val/reward_margin']:+.3f}"
    )
