"""GRPO with verifiable rewards: one loop, read top to bottom.

Each step: draw P prompts; sample G answers per prompt with their logprobs; score them with each
record's environment; group-relative advantages; the reference (and, with several optimizer steps per
rollout, the old) logprobs from the trainer; one or more clipped policy-gradient optimizer steps over
the rollout batch; copy the new weights into the generation engine ("refit"); validate; log. With
`grpo.rollout=agent` agents drive the episodes through the policy's OpenAI-compatible endpoint instead
(rollout/agent.py); the rest of the loop is the same.

As implemented, relative to GRPO (Shao et al. 2024, arXiv:2402.03300):
1. The loss is aggregated per token over the whole global batch by default (DAPO, arXiv:2503.14476),
   not per sequence then per group; `loss.aggregation=sequence` gives the paper's form.
2. The KL penalty (k3) is in the loss, as in the paper, but off by default (`loss.kl_coef=0`) and then
   the reference model is not even loaded.
3. Clip bounds may be asymmetric (`clip_eps_high`, DAPO's clip-higher) and dual clip is optional.
4. The old logprobs come from the trainer, not the generation engine, so the ratio is exactly 1 on
   the first optimizer step; the engine's logprobs are kept to measure train/inference mismatch. With
   one optimizer step per rollout they are the training pass's own (`loss.old_logprobs`).

The GRPO family are settings of this loop and its loss (configs/*_demo.yaml, docs/algorithms.md): DAPO
(dynamic sampling, overlong reward shaping and filtering, clip-higher, token-level loss), GSPO (sequence-
level ratio), Dr.GRPO (no std division, constant normaliser), RLOO (leave-one-out baseline), REINFORCE++
(batch-whitened advantages), CISPO (clipped, detached importance weights), GDPO (rewards normalised per
component).

Recipes of this loop. An algorithm that samples, scores and refits like GRPO but learns differently from
the rollouts is a file of its own with a `Learner` factory: `train(config)` = `grpo.train(config,
make_learner=...)`; its `train_on_batch` reads top to bottom like its algorithm (collate, the extra
models' passes, its advantages, its optimizer steps) and calls the shared parts: `step_metrics.py` for
the metrics, `grpo_advantages.py` and `advantages.py` for rewards and advantages, `losses.py` for the
policy loss, `computed_part` and `make_loss_fn` here. PPO (algorithms/ppo.py, a critic in
`Learner.models`, checkpointed with the policy) and on-policy distillation (algorithms/distill.py, a
frozen teacher) are built so. The loop itself (generation, refit, validation, checkpoints, async) is
written once, here; a recipe never branches inside it.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from reinforge.algorithms.builders import (
    build_engine,
    build_environments,
    build_episodes,
    build_trainer,
    start_ray_if_needed,
    write_placement,
)
from reinforge.algorithms.checkpointing import open_run_dir, restore_rng, resume_run, save_run_checkpoint, update_best
from reinforge.algorithms.dynamic_sampling import fill_with_informative_groups
from reinforge.algorithms.grpo_advantages import kl_reward_penalties, overlong_penalties, step_advantages
from reinforge.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOG_RATIOS,
    POLICY_GRADIENTS,
    Normalisers,
    constant_normaliser,
    grpo_loss,
    sequence_ratio_mask,
    truncated_importance_weights,
)
from reinforge.algorithms.refit import refit
from reinforge.algorithms.rollout_source import RolloutBatch, rollout_source
from reinforge.algorithms.step_metrics import (
    advantage_metrics,
    env_metrics,
    per_task_means,
    rollout_metrics,
    staleness_metrics,
    token_advantage_metrics,
    train_metrics,
)
from reinforge.config import Config, save_config
from reinforge.config.schema import LossConfig
from reinforge.data.batch import TrainBatch, Trajectory, collate
from reinforge.data.curriculum import batch_metrics, build_prompt_sampler
from reinforge.data.prompts import Prompt, PromptSampler, load_prompts
from reinforge.envs.base import Environment
from reinforge.envs.registry import check_tasks
from reinforge.evaluation.evaluate import ValidationBenchmark, benchmark_metrics, prepare_validation_benchmarks
from reinforge.generation import consistency
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.logging.capture import capture_dependency_logs
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import MetricLogger, check_backends
from reinforge.logging.memory import memory_metrics
from reinforge.logging.metrics import Timers
from reinforge.modeling import load_tokenizer
from reinforge.rollout.rollout import Episodes
from reinforge.run_dir import atomic_directory
from reinforge.training.base import TrainingBackend
from reinforge.training.checkpoint import rng_state
from reinforge.training.lora import check_lora


@dataclass
class GRPOResult:
    run_dir: Path
    first_val_accuracy: float | None
    last_val_accuracy: float | None


@dataclass
class Learner:
    """What a recipe of this loop does with each step's rollouts: `train_on_batch(step, rollout_batch, timers)`
    returns the step's metrics and whether the policy changed (the refit is then due). `models`: the
    backends it trains beside the policy (PPO's critic), by name, saved in and restored from every
    checkpoint. GRPO's is `grpo_learner`; PPO and distillation bring their own (algorithms/ppo.py, distill.py)."""

    train_on_batch: Callable[[int, RolloutBatch, Timers], tuple[dict[str, float], bool]]
    title: str = "GRPO"
    models: dict[str, object] = field(default_factory=dict)


MakeLearner = Callable[[Config, TrainingBackend, object, ExitStack], Learner]


def grpo_learner(config: Config, trainer: TrainingBackend, tokenizer, cleanup: ExitStack) -> Learner:
    """Group-relative advantages and the clipped policy-gradient loss (`train_on_batch`)."""
    return Learner(
        partial(train_on_batch, trainer=trainer, tokenizer=tokenizer, loss_fn=make_loss_fn(config), config=config)
    )


def train(
    config: Config, on_step_end: Callable[[int], None] | None = None, make_learner: MakeLearner = grpo_learner
) -> GRPOResult:
    """Run GRPO as `config` says (or, with another `make_learner`, a recipe that shares this loop). `on_step_end`,
    for tools that observe or pace the loop (bench/grpo_vs_trl.py), is called once the run is set up, with
    the step it starts from (0, or the resumed step), then after every step, once it is logged and
    checkpointed, with that step."""
    g = config.grpo
    torch.manual_seed(config.seed)
    if config.cluster.num_threads:
        torch.set_num_threads(config.cluster.num_threads)
    tokenizer = load_tokenizer(config.model)
    train_prompts = load_prompts(config.data.train_path, config.data, tokenizer)
    val_prompts = (
        load_prompts(config.data.val_path, config.data, tokenizer)[: config.data.max_val_prompts]
        if config.data.val_path
        else []
    )

    benchmarks = prepare_validation_benchmarks(g.val_benchmarks, g.val_benchmark_limit, tokenizer)
    tasks = {item.record["task"] for benchmark in benchmarks for item in benchmark.items}
    if g.rollout == "reinforge":  # agents score their own episodes
        tasks |= {p.record.get("task", config.env.default_task) for p in train_prompts + val_prompts} | set(
            config.env.extra_rewards
        )
    check_tasks(tasks, config.env)

    check_backends(config.logging.loggers)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base

    with ExitStack() as cleanup:  # workers, engines and verifier processes are released on every exit path
        # Only once the inputs are known to be good: a bad path never leaves a half-made run directory.
        run_dir, resume_from = open_run_dir(config)
        cleanup.enter_context(capture_dependency_logs(run_dir, config.logging.capture_dependency_logs))
        save_config(
            config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": str(run_dir)})}),
            run_dir / "config.yaml",
        )
        start_ray_if_needed(config, cleanup)
        envs = build_environments(config, tasks, cleanup)
        trainer = build_trainer(config, cleanup)
        engine = build_engine(config, tokenizer, trainer, cleanup)
        episodes = build_episodes(
            config, engine, tokenizer, envs, train_prompts + val_prompts, run_dir, cleanup
        )  # reinforge or agents
        sampler, curriculum_metrics = build_prompt_sampler(
            config, train_prompts, engine, tokenizer, envs, run_dir
        )  # may sample: pass rates
        write_placement(run_dir, trainer, engine, envs)
        learner = make_learner(config, trainer, tokenizer, cleanup)
        state = (
            resume_run(resume_from, run_dir, trainer, engine, sampler, config, learner.models) if resume_from else None
        )
        start_step, val_history, best = (state["step"], state["val_history"], state["best"]) if state else (0, [], {})
        probe_prompts = train_prompts[: config.generation.num_probe_prompts]
        check_consistency(probe_prompts, engine, trainer, tokenizer, config, "at start-up")
        metrics_log = cleanup.enter_context(MetricLogger(run_dir, config.logging.loggers))
        metrics_log.log_config(config.model_dump(mode="json"))
        if state:
            restore_rng(state)  # after the start-up probe, which samples

        with ConsoleLog(g.max_steps, learner.title, completed=start_step) as console:
            console.print(f"run directory: {run_dir}" + (f" (resumed from {resume_from.name})" if resume_from else ""))
            if val_prompts and not state:
                timers = Timers()
                with timers.time("val"):
                    val_metrics = validate(val_prompts, episodes, engine, tokenizer, envs, config, benchmarks)
                val_metrics.update(timers.metrics())
                val_history.append(val_metrics["val/accuracy"])
                metrics_log.log(0, val_metrics)
                console.step(0, val_metrics, show_line=True)

            produce = partial(
                generate_batch, sampler=sampler, episodes=episodes, engine=engine, envs=envs, config=config
            )
            rollouts = rollout_source(
                produce,
                sampler,
                start_step,
                g.max_steps,
                g.async_rollouts,
                g.max_staleness,
                state.get("pending_rollouts", []) if state else [],
            )
            cleanup.callback(rollouts.close)
            if on_step_end:
                on_step_end(start_step)
            for step in range(start_step + 1, g.max_steps + 1):
                timers = Timers()
                with timers.time("step"):
                    batch = rollouts.get(step, timers)  # async: the wait for what generation ahead did not hide
                    metrics, trained = learner.train_on_batch(step, batch, timers)
                saving = bool(config.checkpoint.save_every) and (
                    step % config.checkpoint.save_every == 0 or step == g.max_steps
                )
                with rollouts.engine_turn(step, timers):  # the engine is ours: refit, then probe, validate, snapshot
                    if trained:
                        with timers.time("step"), timers.time("refit"):
                            refit(
                                engine, trainer, config, run_dir
                            )  # merged weights, or the LoRA adapter (algorithms/refit.py)
                    if step == 1:  # the first refit must really have moved the engine to the trainer's weights
                        check_consistency(probe_prompts, engine, trainer, tokenizer, config, "after the first refit")
                    if val_prompts and (step == g.max_steps or (g.val_every and step % g.val_every == 0)):
                        with timers.time("val"):
                            metrics.update(validate(val_prompts, episodes, engine, tokenizer, envs, config, benchmarks))
                        val_history.append(metrics["val/accuracy"])
                    resume_state = {**rollouts.snapshot(), "rng": rng_state()} if saving else None
                metrics.update(timers.metrics())
                metrics["perf/tokens_per_s"] = metrics.pop("perf/num_tokens", 0.0) / timers.seconds["step"]
                metrics.update(memory_metrics("perf/"))  # the driver's; a Ray trainer adds each rank's
                if hasattr(trainer, "memory_metrics"):
                    metrics.update(trainer.memory_metrics())
                metrics.update(curriculum_metrics)
                metrics_log.log(step, metrics)
                console.step(
                    step, metrics, show_line=step % config.logging.console_every == 0 or "val/accuracy" in metrics
                )
                if saving:
                    best = update_best(best, step, metrics, config)
                    save_run_checkpoint(run_dir, step, trainer, resume_state, val_history, best, config, learner.models)
                if on_step_end:
                    on_step_end(step)

            if config.checkpoint.save_final:
                with atomic_directory(run_dir / "final") as tmp:
                    trainer.save_pretrained(tmp)
                    tokenizer.save_pretrained(tmp)

    first, last = (val_history[0], val_history[-1]) if val_history else (None, None)
    if first is not None:
        console.print(f"val/accuracy at step 0: {first:.3f}")
        console.print(f"val/accuracy at step {g.max_steps}: {last:.3f} ({last - first:+.3f})")
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}"
        + (f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else "")
    )
    return GRPOResult(run_dir=run_dir, first_val_accuracy=first, last_val_accuracy=last)


def generate_batch(
    step: int,
    sampler: PromptSampler,
    episodes: Episodes,
    engine: GenerationBackend,
    envs: dict[str, Environment],
    config: Config,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Step `step`'s scored groups and their metrics (generation and scoring times, environment and agent
    counters). Runs on the rollout producer's thread under async generation."""
    timers = Timers()
    trajectories, metrics = sample_groups(step, sampler, episodes, config, timers)
    if not config.grpo.async_rollouts:
        engine.sleep()  # with vLLM sleep mode on GPU, the trainer gets the engine's memory until the refit
    return trajectories, {
        **metrics,
        **episodes.metrics(),
        **batch_metrics(sampler),
        **env_metrics(envs),
        **timers.metrics(),
    }


def train_on_batch(
    step: int,
    rollout_batch: RolloutBatch,
    timers: Timers,
    *,
    trainer: TrainingBackend,
    tokenizer,
    loss_fn,
    config: Config,
) -> tuple[dict[str, float], bool]:
    """Advantages, logprobs and the optimizer steps on one step's rollout batch. Returns its metrics and
    whether the policy changed (the refit is then due)."""
    g, global_batch = config.grpo, config.training.global_batch_size
    trajectories = rollout_batch.trajectories
    metrics = {**rollout_batch.metrics, **staleness_metrics(step, rollout_batch)}
    if not trajectories:  # dynamic sampling found no group with unequal rewards: nothing to learn from
        return metrics, False
    rewards_PG = torch.tensor([t.reward for t in trajectories]).view(-1, g.num_generations_per_prompt)
    penalties_PG = overlong_penalties(trajectories, config).view_as(rewards_PG)
    batch = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    if g.overlong_filtering:  # DAPO: truncated answers are not trained on (their rewards still set the baseline)
        batch.loss_mask *= torch.tensor([[0.0 if t.truncated else 1.0] for t in trajectories])

    loss = config.loss
    with timers.time("logprobs"):  # else the loss takes the training pass's as the old policy's
        if loss.old_logprobs == "recompute" or len(batch) > global_batch or loss.kl_in_reward:
            batch.old_logprobs = trainer.logprobs(batch)
        if loss.kl_coef > 0:
            batch.ref_logprobs = trainer.logprobs(batch, reference=True)
    kl_penalties_PG = -kl_reward_penalties(batch, config).view_as(rewards_PG)  # loss.kl_in_reward
    shaping = [
        term for term, on in ((penalties_PG, g.overlong_buffer_tokens > 0), (kl_penalties_PG, loss.kl_in_reward)) if on
    ]
    advantages_PG, advantage_parts = step_advantages(
        trajectories, rewards_PG, shaping, batch, config
    )  # GRPO, GDPO, whitened
    batch.advantages = advantages_PG.flatten()
    with timers.time("train"):  # one optimizer step per global batch of the rollout that has tokens to train on
        global_batches = [batch.slice(s, s + global_batch) for s in range(0, len(batch), global_batch)]
        updates = [
            trainer.train_step(computed_part(b, config), loss_fn) for b in global_batches if b.num_valid_tokens()
        ]  # 0: all overlong-filtered
    return {
        **metrics,
        **rollout_metrics(trajectories, rewards_PG),
        **advantage_metrics(trajectories, penalties_PG, advantages_PG, config),
        **token_advantage_metrics(batch, kl_penalties_PG, config),
        **advantage_parts,
        **train_metrics(updates),  # the engine/trainer mismatch (train/token_mult_prob_error, ...) among them
        "perf/num_tokens": batch.attention_mask.sum().item(),
    }, bool(updates)


def computed_part(batch: TrainBatch, config: Config) -> TrainBatch:
    """A global batch without the sequences that add nothing to its loss (`grpo.skip_zero_advantage`):
    with no KL term in the loss a zero-advantage sequence's loss is 0 whatever the policy, and so is that of a
    sequence with no token to train on (DAPO's overlong filtering). The part keeps the whole batch's
    normalisers, so its gradient is the batch's. The part is topped up with the shortest of the others
    (adding 0) to a whole number of sequences per training rank, at least one each: FSDP2 ranks take
    equal shares, and the optimizer step still runs when nothing is left (AdamW's moments move the
    weights even on a zero gradient)."""
    if not config.grpo.skip_zero_advantage or (config.loss.kl_coef > 0 and not config.loss.kl_in_reward):
        return batch
    keep = ((batch.advantages != 0) & (batch.loss_mask.sum(dim=1) > 0)).nonzero().flatten().tolist()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    fillers = sorted(set(range(len(batch))) - set(keep), key=lambda i: (lengths[i], i))
    ranks = config.training.num_workers
    keep = sorted(keep + fillers[: max(ranks, -(-len(keep) // ranks) * ranks) - len(keep)])
    if len(keep) == len(batch):
        return batch
    part = batch.select(keep)
    part.loss_normalisers = Normalisers(
        num_tokens=batch.num_valid_tokens(), num_sequences=len(batch), num_computed_tokens=part.num_valid_tokens()
    )
    return part


def sample_groups(
    step: int, sampler: PromptSampler, episodes: Episodes, config: Config, timers: Timers
) -> tuple[list[Trajectory], dict[str, float]]:
    """The step's scored groups: one rollout of the next `num_prompts_per_step` prompts, or, with dynamic
    sampling, as many rollouts of further prompts as `fill_with_informative_groups` needs."""
    g = config.grpo

    def rollout_round(round_index: int) -> list[Trajectory]:
        params = sampling_params(config, step)
        params = replace(params, seed=params.seed + 500_009 * round_index)  # a fresh stream per extra round
        return episodes(sampler.next_batch(), params, timers)

    if not g.dynamic_sampling:
        return rollout_round(0), {}
    return fill_with_informative_groups(
        rollout_round, g.num_prompts_per_step, g.num_generations_per_prompt, g.dynamic_sampling_max_extra_rounds
    )


def check_consistency(
    prompts: list[Prompt], engine: GenerationBackend, trainer: TrainingBackend, tokenizer, config: Config, when: str
) -> None:
    """Stop the run if the engine's logprobs disagree with the trainer's (see generation/consistency.py)."""
    params = sampling_params(config, 0)
    error = consistency.probe(prompts, engine, trainer, tokenizer, params)
    consistency.check(error, config.generation.max_logprob_error, when, params)


def sampling_params(config: Config, step: int) -> SamplingParams:
    gen = config.generation
    return SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        stop_strings=tuple(gen.stop_strings),
        num_samples=config.grpo.num_generations_per_prompt,
        seed=config.seed * 1_000_003 + step,  # a fresh, reproducible stream per step
    )


def importance_weights(
    loss: LossConfig, correction: str, old_logprobs_BT: torch.Tensor, micro: TrainBatch
) -> torch.Tensor | None:
    """Per-token weights correcting for the engine's sampling distribution differing from the trainer's
    (numerics, or under async generation an older policy); `correction` is `loss.is_correction` resolved."""
    if correction == "token_truncate":
        return truncated_importance_weights(old_logprobs_BT, micro.gen_logprobs, loss.is_truncate_cap)
    if correction == "sequence_mask":
        return sequence_ratio_mask(
            old_logprobs_BT, micro.gen_logprobs, micro.loss_mask, loss.is_sequence_low, loss.is_sequence_high
        )
    return None


def make_loss_fn(config: Config):
    """The GRPO loss of a micro-batch, with the engine/trainer mismatch among its metrics."""
    loss = config.loss
    if loss.aggregation == "constant":
        aggregate = constant_normaliser(loss.constant_normaliser_tokens or config.generation.max_new_tokens)
    else:
        aggregate = AGGREGATIONS[loss.aggregation]
    correction = loss.is_correction
    if correction == "auto":
        correction = "token_truncate" if config.grpo.async_rollouts and config.grpo.max_staleness > 0 else "none"

    def loss_fn(logprobs_BT: torch.Tensor, micro: TrainBatch, norm):
        # Without a pass of their own (loss.old_logprobs), the old policy is the one being trained: this pass's logprobs
        old_BT = logprobs_BT.detach() if micro.old_logprobs is None else micro.old_logprobs
        value, metrics = grpo_loss(
            logprobs_BT,
            old_BT,
            micro.advantages,
            micro.loss_mask,
            norm,
            aggregate=aggregate,
            log_ratio=LOG_RATIOS[loss.ratio_level],
            eps_low=loss.clip_eps_low,
            eps_high=loss.clip_eps_high,
            dual_clip_c=loss.dual_clip_c,
            policy_gradient=POLICY_GRADIENTS[loss.policy_loss],
            kl_coef=0.0 if loss.kl_in_reward else loss.kl_coef,  # in the reward: measured (train/kl), not trained on
            kl_estimator=KL_ESTIMATORS[loss.kl_estimator],
            ref_logprobs_BT=micro.ref_logprobs,
            is_weights_BT=importance_weights(loss, correction, old_BT, micro),
        )
        return value, {
            **metrics,
            **consistency.mismatch_contributions(old_BT, micro.gen_logprobs, micro.loss_mask, norm),
        }

    return loss_fn


def validate(
    prompts: list[Prompt],
    episodes: Episodes,
    engine: GenerationBackend,
    tokenizer,
    envs: dict[str, Environment],
    config: Config,
    benchmarks: list[ValidationBenchmark] = (),
) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts (the mean reward of one greedy answer per prompt), and the
    `grpo.val_benchmarks` scores."""
    benchmark_scores = (
        benchmark_metrics(
            list(benchmarks),
            engine,
            tokenizer,
            envs,
            config.grpo.val_benchmark_k,
            config.generation.max_new_tokens,
            config.seed,
        )
        if benchmarks
        else {}
    )
    params = SamplingParams(
        max_new_tokens=config.generation.max_new_tokens,
        temperature=0.0,
        num_samples=1,
        stop_strings=tuple(config.generation.stop_strings),
    )
    trajectories = episodes(prompts, params)
    return {
        **{f"val/{name}": value for name, value in env_metrics(envs).items()},  # the validation's own env counters
        **{
            f"val/{name.split('/', 1)[1]}": value
            for name, value in episodes.metrics().items()
            if name.startswith("rollout/agent_")
        },
        "val/accuracy": sum(t.reward for t in trajectories) / len(trajectories),
        "val/gen_len_mean": sum(len(t.response_ids) for t in trajectories) / len(trajectories),
        **per_task_means(trajectories, "val", "accuracy"),
        **benchmark_scores,
    }
