"""The RL loop, written once: GRPO, PPO and on-policy distillation are its recipes.

Each step: take the step's scored rollouts (generated now, or ahead of training under async generation,
rollout_source.py); hand them to the recipe's `Learner` (its advantages, extra models and optimizer steps);
copy the new weights into the generation engine ("refit"); check, after the first refit, that the engine really
moved to the trainer's weights; validate every `loop.val_every` steps; log; checkpoint. Every wait has a deadline;
a watchdog, beaten at each phase, stops a run that makes no progress for `deadlines.step_s`; a wait past its deadline
writes RUN_DIR/hang_report.txt (every thread's and worker's stack) and ends the run with one line (hang.py).
With `rollout.driver=agent` agents drive the episodes through the policy's OpenAI-compatible endpoint
(rollout/agent.py); the loop is the same.

A recipe is a file with a root config (an `RLRunConfig` plus its own sections) and a `make_learner(config,
trainer, tokenizer, cleanup) -> Learner`; `run(config, make_learner)` does the rest. The loop never branches on
which recipe it runs.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from typing import Callable

import torch

from reinforge.algorithms import consistency
from reinforge.algorithms.learner import MakeLearner, RolloutRound, RunResult
from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.algorithms.step_metrics import env_metrics, per_task_means, scored_tasks
from reinforge.config.loader import save_config
from reinforge.data.batch import Trajectory
from reinforge.data.curriculum import batch_metrics
from reinforge.data.prompt_stream import stream_sampler
from reinforge.data.prompts import Prompt, PromptSampler, load_prompts
from reinforge.envs.base import Environment
from reinforge.envs.registry import check_tasks
from reinforge.errors import ConfigError
from reinforge.evaluation.evaluate import ValidationBenchmark, benchmark_metrics, prepare_validation_benchmarks
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.hang import REPORT_NAME, Watchdog, hang_reports
from reinforge.logging.capture import capture_dependency_logs
from reinforge.logging.console import ConsoleLog
from reinforge.logging.loggers import MetricLogger, check_backends
from reinforge.logging.memory import memory_metrics
from reinforge.logging.metrics import Timers
from reinforge.loops.builders import (
    build_engine,
    build_environments,
    build_episodes,
    build_trainer,
    start_ray_if_needed,
    write_placement,
)
from reinforge.loops.checkpointing import (
    ResumeState,
    log_trained_prompts,
    open_run_dir,
    resume_run,
    save_run_checkpoint,
    update_best,
)
from reinforge.loops.curriculum_prefilter import build_prompt_sampler
from reinforge.loops.refit import refit
from reinforge.loops.run_checks import check_run_inputs
from reinforge.modeling import load_processor, load_tokenizer, save_tokenizer
from reinforge.rollout.in_flight import InFlightRollouts
from reinforge.rollout.rollout import Episodes
from reinforge.rollout.source import rollout_source
from reinforge.run_dir import announce_run_dir, atomic_directory
from reinforge.training.base import TrainingBackend
from reinforge.training.checkpoint import rng_state, set_rng_state
from reinforge.training.lora import check_lora


def run(config: RLRunConfig, make_learner: MakeLearner, on_step_end: Callable[[int], None] | None = None) -> RunResult:
    """Run the RL loop with the recipe's learner. `on_step_end`, for tools that observe or pace the loop
    (bench/grpo_vs_trl.py), is called once the run is set up, with the step it starts from (0, or the resumed
    step), then after every step, once it is logged and checkpointed, with that step."""
    loop = config.loop
    torch.manual_seed(config.seed)
    if config.cluster.num_threads:
        torch.set_num_threads(config.cluster.num_threads)
    tokenizer = load_tokenizer(config.model)
    processor = load_processor(config.model)  # a vision-language model's, for image prompts; None: text-only
    stream = stream_sampler(
        config.data, config.curriculum, tokenizer, config.rollout.num_prompts_per_step, config.seed, processor
    )
    train_prompts = stream.head() if stream else load_prompts(config.data.train_path, config.data, tokenizer, processor)
    val_prompts = []
    if config.data.val_path:
        val_prompts = load_prompts(config.data.val_path, config.data, tokenizer, processor, val=True)[
            : config.data.max_val_prompts
        ]

    benchmarks = prepare_validation_benchmarks(loop.val_benchmarks, loop.val_benchmark_limit, tokenizer, processor)
    tasks = {item.record["task"] for benchmark in benchmarks for item in benchmark.items}
    if config.rollout.driver == "reinforge":  # agents score their own episodes
        tasks |= {p.record.get("task", config.env.default_task) for p in train_prompts + val_prompts}
        tasks |= set(config.env.extra_rewards)
    check_tasks(tasks, config.env)
    check_backends(config.logging.loggers)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    check_run_inputs(config, train_prompts + val_prompts)  # no weights, too long for the model, agents not importable

    with ExitStack() as cleanup:  # workers, engines and verifier processes are released on every exit path
        # Only once the inputs are known to be good: a bad path never leaves a half-made run directory.
        run_dir, resume_from = open_run_dir(config)
        cleanup.enter_context(hang_reports(run_dir))  # exits last: a HangError's stacks were taken when it was raised
        announce_run_dir(run_dir)  # to the supervisor, if any: a restart resumes here
        cleanup.enter_context(capture_dependency_logs(run_dir, config.logging.capture_dependency_logs))
        logging_here = config.logging.model_copy(update={"run_dir": str(run_dir)})
        save_config(config.model_copy(update={"logging": logging_here}), run_dir / "config.yaml")
        start_ray_if_needed(config, cleanup)
        envs = build_environments(config, tasks, cleanup)
        trainer = build_trainer(config, cleanup)
        engine = build_engine(config, tokenizer, trainer, cleanup)
        all_prompts = train_prompts + val_prompts
        episodes = build_episodes(config, engine, tokenizer, envs, all_prompts, run_dir, cleanup)
        # may sample with the engine: the curriculum's pass rates
        sampler, curriculum_metrics = (
            (stream, {}) if stream else build_prompt_sampler(config, train_prompts, engine, tokenizer, envs, run_dir)
        )
        write_placement(run_dir, trainer, engine, envs)
        learner = make_learner(config, trainer, tokenizer, cleanup)
        state = (
            resume_run(resume_from, run_dir, trainer, engine, sampler, config, learner.models) if resume_from else None
        )
        start_step = state.step if state else 0
        val_history, best = (state.val_history, state.best) if state else ([], {})
        probe_prompts = train_prompts[: config.generation.num_probe_prompts]
        check_consistency(probe_prompts, engine, trainer, tokenizer, config, "at start-up")
        metrics_log = cleanup.enter_context(MetricLogger(run_dir, config.logging.loggers))
        metrics_log.log_config(config.model_dump(mode="json"))
        if state:
            set_rng_state(state.rng)  # after the start-up probe, which samples

        with ConsoleLog(loop.max_steps, learner.title, completed=start_step) as console:
            resumed = f" (resumed from {resume_from.name})" if resume_from else ""
            console.print(f"run directory: {run_dir}{resumed}")
            # from here on, not during start-up (model loading, the curriculum's pre-filter may take long)
            watchdog = cleanup.enter_context(Watchdog(config.deadlines.step_s, run_dir / REPORT_NAME))
            if val_prompts and not state:
                watchdog.beat("the first validation")
                timers = Timers()
                with timers.time("val"):
                    val_metrics = validate(val_prompts, episodes, engine, tokenizer, envs, config, benchmarks)
                val_metrics.update(timers.metrics())
                val_history.append(val_metrics["val/accuracy"])
                metrics_log.log(0, val_metrics)
                console.step(0, val_metrics, show_line=True)

            produce = partial(generate_batch, sampler=sampler, episodes=episodes, engine=engine, envs=envs,
                              config=config, collect_groups=learner.collect_groups)  # fmt: skip
            pending = state.pending_rollouts if state else []
            if config.rollout.mode == "in_flight":
                engine.version = start_step  # the policy the start-up (or resume) refit left in the engine
                rollouts = in_flight_rollouts(config, sampler, episodes, engine, envs, learner, pending)
            else:
                rollouts = rollout_source(
                    produce,
                    sampler,
                    start_step,
                    loop.max_steps,
                    config.rollout.mode,
                    config.rollout.max_staleness,
                    pending,
                    config.deadlines.rollout_wait_s,
                )
            cleanup.callback(rollouts.close)
            if on_step_end:
                on_step_end(start_step)
            for step in range(start_step + 1, loop.max_steps + 1):
                watchdog.beat(f"step {step}'s rollouts and training")
                timers = Timers()
                with timers.time("step"):
                    batch = rollouts.get(step, timers)  # async: the wait for what generation ahead did not hide
                    result = learner.train_on_batch(step, batch, timers)
                metrics = result.metrics
                every = config.checkpoint.save_every
                saving = bool(every) and (step % every == 0 or step == loop.max_steps)
                watchdog.beat(f"step {step}'s refit and validation")
                with rollouts.engine_turn(step, timers):  # the engine is ours: refit, then probe, validate, snapshot
                    if result.trained:
                        with timers.time("step"), timers.time("refit"):
                            refit(engine, trainer, config, run_dir, step, timers)  # weights or adapter, verified
                    if step == 1:  # the first refit must really have moved the engine to the trainer's weights
                        check_consistency(probe_prompts, engine, trainer, tokenizer, config, "after the first refit")
                    if val_prompts and (step == loop.max_steps or (loop.val_every and step % loop.val_every == 0)):
                        with timers.time("val"):
                            metrics.update(validate(val_prompts, episodes, engine, tokenizer, envs, config, benchmarks))
                        val_history.append(metrics["val/accuracy"])
                    snapshot = rollouts.snapshot() if saving else None
                    rng = rng_state() if saving else None
                watchdog.beat(f"step {step}'s logging and checkpoint")
                metrics.update(timers.metrics())
                metrics["perf/tokens_per_s"] = result.num_tokens / timers.seconds["step"]
                metrics.update(memory_metrics("perf/"))  # the driver's
                metrics.update(trainer.memory_metrics())  # each rank's, when the ranks are processes of their own
                metrics.update(curriculum_metrics)
                metrics.update(log_trained_prompts(run_dir, step, batch.trajectories))
                metrics_log.log(step, metrics)
                show = step % config.logging.console_every == 0 or "val/accuracy" in metrics
                console.step(step, metrics, show_line=show)
                if saving:
                    best = update_best(best, step, metrics, config.checkpoint)
                    resume_state = ResumeState(step, snapshot["sampler"], snapshot["pending"], rng, val_history, best)
                    save_run_checkpoint(run_dir, resume_state, trainer, config, learner.models)
                if on_step_end:
                    on_step_end(step)

            if config.checkpoint.save_final:
                watchdog.beat("the final model to be saved")
                with atomic_directory(run_dir / "final") as tmp:
                    trainer.save_pretrained(tmp)
                    save_tokenizer(config.model, tmp)

    first, last = (val_history[0], val_history[-1]) if val_history else (None, None)
    if first is not None:
        console.print(f"val/accuracy at step 0: {first:.3f}")
        console.print(f"val/accuracy at step {loop.max_steps}: {last:.3f} ({last - first:+.3f})")
    final = f"   final model: {run_dir / 'final'}" if config.checkpoint.save_final else ""
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}{final}")
    return RunResult(run_dir=run_dir, first_val_accuracy=first, last_val_accuracy=last)


def generate_batch(
    step: int,
    sampler: PromptSampler,
    episodes: Episodes,
    engine: GenerationBackend,
    envs: dict[str, Environment],
    config: RLRunConfig,
    collect_groups: Callable[[RolloutRound], tuple[list[Trajectory], dict[str, float]]] | None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Step `step`'s scored groups and their metrics (generation and scoring times, environment and agent
    counters). Runs on the rollout producer's thread under async generation."""
    timers = Timers()

    def rollout_round(round_index: int) -> list[Trajectory]:
        params = sampling_params(config, step)
        params = replace(params, seed=params.seed + 500_009 * round_index)  # a fresh stream per extra round
        first_ordinal = sampler.drawn
        trajectories = episodes(sampler.next_batch(), params, timers)
        for trajectory in trajectories:
            trajectory.prompt_ordinal = first_ordinal + trajectory.group
        tasks.update(trajectory.task for trajectory in trajectories)  # every round's, kept or not
        return trajectories

    tasks: set[str] = set()
    trajectories, metrics = collect_groups(rollout_round) if collect_groups else (rollout_round(0), {})
    if config.rollout.mode == "sync":
        engine.sleep()  # with vLLM sleep mode on GPU, the trainer gets the engine's memory until the refit
    scored = scored_tasks(tasks, config.rollout.driver, config.env.extra_rewards)
    counters = {**episodes.metrics(), **batch_metrics(sampler), **env_metrics(envs, scored)}
    return trajectories, {**metrics, **counters, **timers.metrics()}


def in_flight_rollouts(config: RLRunConfig, sampler, episodes: Episodes, engine, envs, learner, pending):
    """`rollout.mode=in_flight`'s rollout source (rollout/in_flight.py): each group generated by a
    worker of its own through the in-flight engine, with a seed of its prompt's ordinal."""
    if learner.collect_groups is not None:
        raise ConfigError(
            "rollout.mode=in_flight takes each finished group as it comes; this recipe's extra rounds of groups "
            "(dynamic sampling) need rollout.mode=sync or async"
        )
    rollout = config.rollout

    def produce_group(ordinal: int, prompt: Prompt) -> tuple[list[Trajectory], dict[str, float]]:
        timers = Timers()
        params = replace(sampling_params(config, 0), seed=config.seed * 1_000_003 + 7_919 * (ordinal + 1))
        started = engine.version  # no token of the group is older
        trajectories = episodes([prompt], params, timers)
        for trajectory in trajectories:
            trajectory.prompt_ordinal = ordinal
            if trajectory.token_versions is None:  # an episode with no tokens (it failed) or whose calls did not say
                trajectory.policy_version = started
        return trajectories, timers.metrics()

    def step_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
        """The counters since the last step: the episodes', the sampler's, the environments', the engine's."""
        tasks = scored_tasks({t.task for t in trajectories}, rollout.driver, config.env.extra_rewards)
        return {**episodes.metrics(), **batch_metrics(sampler), **env_metrics(envs, tasks), **engine.metrics()}

    return InFlightRollouts(
        produce_group,
        sampler,
        rollout.num_prompts_per_step,
        rollout.pool_groups,
        rollout.max_staleness,
        pending,
        config.deadlines.rollout_wait_s,
        step_metrics,
    )


def check_consistency(
    prompts: list[Prompt],
    engine: GenerationBackend,
    trainer: TrainingBackend,
    tokenizer,
    config: RLRunConfig,
    when: str,
) -> None:
    """Stop the run if the engine's logprobs disagree with the trainer's (see algorithms/consistency.py)."""
    params = sampling_params(config, 0)
    error = consistency.probe(prompts, engine, trainer, tokenizer, params)
    consistency.check(error, config.generation.max_logprob_error, when, params)


def sampling_params(config: RLRunConfig, step: int) -> SamplingParams:
    gen = config.generation
    return SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        stop_strings=tuple(gen.stop_strings),
        num_samples=config.rollout.num_generations_per_prompt,
        seed=config.seed * 1_000_003 + step,  # a fresh, reproducible stream per step
        record_routes=config.model.moe.router_replay == "rollout",  # the trainer replays the engine's routes
    )


def validate(
    prompts: list[Prompt],
    episodes: Episodes,
    engine: GenerationBackend,
    tokenizer,
    envs: dict[str, Environment],
    config: RLRunConfig,
    benchmarks: list[ValidationBenchmark] = (),
) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts (the mean reward of one greedy answer per prompt), and the
    `loop.val_benchmarks` scores."""
    gen = config.generation
    benchmark_scores = {}
    if benchmarks:
        benchmark_scores = benchmark_metrics(
            list(benchmarks), engine, tokenizer, envs, config.loop.val_benchmark_k, gen.max_new_tokens, config.seed
        )
    params = SamplingParams(
        max_new_tokens=gen.max_new_tokens, temperature=0.0, num_samples=1, stop_strings=tuple(gen.stop_strings)
    )
    trajectories = [t for t in episodes(prompts, params) if not t.excluded]  # no verdict: infra failures
    scored = scored_tasks({t.task for t in trajectories}, config.rollout.driver, config.env.extra_rewards)
    scored |= {item.record["task"] for benchmark in benchmarks for item in benchmark.items}
    agent_counters = {
        f"val/{name.split('/', 1)[1]}": value
        for name, value in episodes.metrics().items()
        if name.startswith(("rollout/agent_", "rollout/infra_"))
    }
    return {
        **{f"val/{name}": value for name, value in env_metrics(envs, scored).items()},  # the validation's own
        **agent_counters,
        "val/accuracy": sum(t.reward for t in trajectories) / len(trajectories),
        "val/gen_len_mean": sum(len(t.response_ids) for t in trajectories) / len(trajectories),
        **per_task_means(trajectories, "val", "accuracy"),
        **benchmark_scores,
    }
