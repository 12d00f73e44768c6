"""Llama-Nemotron's pass-rate pre-filter (Bercovich et al. 2025, arXiv:2505.00949, LN-Ultra's reasoning RL;
`curriculum.*`, docs/algorithms.md), the run's prompt sampler built on it, and `reinforge curriculum prefilter`.
The progressive sampler itself is data (reinforge/data/curriculum.py); this module runs the rollouts.

Pre-filter: sample k = `prefilter_samples` answers to every training prompt and score them with the
prompt's environment; the pass rate is the fraction of answers whose reward is >= `success_reward` (with
0/1 rewards: the mean reward), a multiple of 1/k. Prompts with pass rate >= `prefilter_threshold` are
dropped. The rates are computed once per run and written atomically to RUN_DIR/curriculum/
(pass_rates.jsonl, one line per prompt, and prefilter.json, the settings that produced them); a resumed
or restarted run with the same settings and prompts reads them back instead of sampling. Records that
carry a `pass_rate` field use it and are never sampled (`reinforge curriculum prefilter` writes them).

Deviation from the paper: the pass rates come from the initial policy being trained, not from another
model (LN-Super scored LN-Ultra's data there); `reinforge curriculum prefilter` with another
`model.name_or_path` gives the paper's setup.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from reinforge.data.curriculum import ProgressiveSampler, histogram, record_pass_rates
from reinforge.data.prompts import Prompt, PromptSampler, load_prompts
from reinforge.envs.registry import check_tasks
from reinforge.errors import DataError
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.loops.builders import build_engine, build_environments, start_ray_if_needed
from reinforge.modeling import load_tokenizer
from reinforge.rollout.infra import NO_HOLES
from reinforge.rollout.rollout import RolloutOptions, settled_rollout
from reinforge.run_dir import atomic_directory

if TYPE_CHECKING:
    from reinforge.algorithms.rl_config import RLRunConfig
    from reinforge.envs.base import Environment

PASS_RATES_FILE = "pass_rates.jsonl"
SETTINGS_FILE = "prefilter.json"
PROMPTS_PER_ROLLOUT = 256  # prompts per rollout call of the pre-filter (a constant: the samples depend on it)
PREFILTER_SEED_OFFSET = 700_001  # a sampling stream apart from the training steps' (seed * 1_000_003 + step)


def measure_pass_rates(
    prompts: list[Prompt],
    engine: GenerationBackend,
    params: SamplingParams,
    tokenizer,
    envs: dict[str, Environment],
    options: RolloutOptions,
    success_reward: float,
    console_print: Callable[[str], None] = print,
) -> list[float]:
    """Each prompt's fraction of `params.num_samples` sampled answers with reward >= `success_reward`."""
    pass_rates: list[float] = []
    for index, start in enumerate(range(0, len(prompts), PROMPTS_PER_ROLLOUT)):
        chunk = prompts[start : start + PROMPTS_PER_ROLLOUT]
        chunk_params = replace(params, seed=params.seed + 104_729 * index)
        passed = [0] * len(chunk)
        trajectories, _ = settled_rollout(chunk, engine, chunk_params, tokenizer, envs, options, NO_HOLES)
        for trajectory in trajectories:  # no infrastructure failure left: each is the environment's verdict
            passed[trajectory.group] += trajectory.reward >= success_reward
        pass_rates += [count / params.num_samples for count in passed]
        console_print(f"curriculum pre-filter: {len(pass_rates)}/{len(prompts)} prompts sampled")
    return pass_rates


def prefilter_setup(config: RLRunConfig) -> tuple[SamplingParams, RolloutOptions]:
    """The pre-filter's sampling (the training rollouts' settings, k samples, its own seed) and rollout options."""
    generation, curriculum, rollout = config.generation, config.curriculum, config.rollout
    params = SamplingParams(
        max_new_tokens=generation.max_new_tokens,
        temperature=curriculum.prefilter_temperature or generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        stop_strings=tuple(generation.stop_strings),
        num_samples=curriculum.prefilter_samples,
        seed=config.seed * 1_000_003 + PREFILTER_SEED_OFFSET,
    )
    options = RolloutOptions(
        default_task=config.env.default_task,
        max_turns=rollout.max_turns,
        turn_reward=rollout.turn_reward,
        max_observation_tokens=rollout.max_observation_tokens,
        extra_rewards=config.env.extra_rewards,
    )
    return params, options


def prefilter_settings(config: RLRunConfig, prompts: list[Prompt]) -> dict[str, Any]:
    """What the stored pass rates depend on; stored rates are reused only when all of it is unchanged."""
    params, options = prefilter_setup(config)
    digest = hashlib.sha256(json.dumps([[p.token_ids, p.record] for p in prompts], sort_keys=True).encode()).hexdigest()
    sampling = {
        **asdict(params),
        "stop_strings": list(params.stop_strings),
        "stop_token_ids": list(params.stop_token_ids),
    }
    engine = {"backend": config.generation.backend, "max_batch_size": config.generation.max_batch_size}
    return {
        "model": config.model.model_dump(mode="json"),
        "engine": engine,
        "sampling": sampling,
        "rollout": asdict(options),
        "success_reward": config.curriculum.success_reward,
        "prompts_sha256": digest,
    }


def pass_rates_for(
    config: RLRunConfig,
    prompts: list[Prompt],
    engine: GenerationBackend | None,
    tokenizer,
    envs: dict[str, Environment],
    run_dir: Path,
    console_print: Callable[[str], None] = print,
) -> list[float]:
    """The training prompts' pass rates: the records', else the run's stored ones, else sampled now and stored."""
    rates = record_pass_rates(prompts)
    if rates is not None:
        return rates
    if not config.curriculum.prefilter:
        raise DataError(
            "curriculum.sampler=progressive needs pass rates: set curriculum.prefilter=true, or give every record "
            "of data.train_path a pass_rate field (`reinforge curriculum prefilter` writes them)"
        )
    directory, settings = run_dir / "curriculum", prefilter_settings(config, prompts)
    try:
        stored = json.loads((directory / SETTINGS_FILE).read_text())
        rows = [json.loads(line) for line in (directory / PASS_RATES_FILE).read_text().splitlines()]
        if stored["settings"] == settings and len(rows) == len(prompts):
            console_print(f"curriculum pre-filter: pass rates read from {directory / PASS_RATES_FILE}")
            return [row["pass_rate"] for row in rows]
        console_print(f"curriculum pre-filter: {directory} was computed with other settings or prompts; sampling again")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none stored yet (or a stale, unreadable copy): sample
    assert engine is not None, "no stored pass rates to read: the pre-filter needs the engine"
    params, options = prefilter_setup(config)
    rates = measure_pass_rates(
        prompts, engine, params, tokenizer, envs, options, config.curriculum.success_reward, console_print
    )
    counters = {f"{task}/{name}": value for task, env in envs.items() for name, value in env.metrics().items() if value}
    if counters:  # drained so that step 1's env metrics count step 1 only
        console_print(f"curriculum pre-filter: environment counters {counters}")
    with atomic_directory(directory) as tmp:
        (tmp / PASS_RATES_FILE).write_text(
            "".join(
                json.dumps(
                    {
                        "index": i,
                        "prompt": p.messages[-1]["content"],
                        "pass_rate": rate,
                        "num_passed": round(rate * params.num_samples),
                        "num_samples": params.num_samples,
                    }
                )
                + "\n"
                for i, (p, rate) in enumerate(zip(prompts, rates))
            )
        )
        (tmp / SETTINGS_FILE).write_text(json.dumps({"settings": settings, "histogram": histogram(rates)}, indent=1))
    return rates


def build_prompt_sampler(
    config: RLRunConfig,
    train_prompts: list[Prompt],
    engine: GenerationBackend | None,
    tokenizer,
    envs: dict[str, Environment],
    run_dir: Path,
    console_print: Callable[[str], None] = print,
) -> tuple[PromptSampler | ProgressiveSampler, dict[str, float]]:
    """The run's prompt sampler and the curriculum's one-off metrics ({} with the curriculum off): a plain
    `PromptSampler` unless `curriculum.prefilter` or `curriculum.sampler=progressive` asks for more."""
    curriculum, rollout, loop = config.curriculum, config.rollout, config.loop
    if not curriculum.prefilter and curriculum.sampler == "uniform":
        return PromptSampler(train_prompts, rollout.num_prompts_per_step, config.seed, config.data.shuffle), {}
    rates = pass_rates_for(config, train_prompts, engine, tokenizer, envs, run_dir, console_print)
    keep = [i for i, rate in enumerate(rates) if not curriculum.prefilter or rate < curriculum.prefilter_threshold]
    if not keep:
        raise DataError(
            "every training prompt has a pass rate >= "
            f"curriculum.prefilter_threshold={curriculum.prefilter_threshold}; "
            "raise the threshold or train on harder prompts"
        )
    console_print(
        f"curriculum: pass rates of {len(rates)} prompts {histogram(rates)}; kept {len(keep)}"
        + (f" below {curriculum.prefilter_threshold}" if curriculum.prefilter else "")
    )
    prompts, kept_rates = [train_prompts[i] for i in keep], [rates[i] for i in keep]
    metrics = {
        "curriculum/num_prompts_kept": len(keep),
        "curriculum/prefilter_dropped_fraction": 1 - len(keep) / len(rates),
        "curriculum/kept_pass_rate_mean": sum(kept_rates) / len(kept_rates),
    }
    if curriculum.sampler == "uniform":
        return PromptSampler(prompts, rollout.num_prompts_per_step, config.seed, config.data.shuffle), metrics
    sampler = ProgressiveSampler(
        prompts,
        kept_rates,
        rollout.num_prompts_per_step,
        config.seed,
        curriculum.num_steps or loop.max_steps,
        curriculum.start_pass_rate,
        curriculum.end_pass_rate,
        curriculum.sigma,
        curriculum.num_bins,
    )
    return sampler, metrics


def prefilter_file(config: RLRunConfig, out: Path, keep_all: bool) -> tuple[int, int]:
    """`reinforge curriculum prefilter`: measure the pass rates of data.train_path's prompts with the config's model
    and engine in this process, and write the records with a `pass_rate` field to `out` (those below the
    threshold, or all with `keep_all`). Returns (records written, prompts measured)."""
    if config.cluster.num_threads:
        torch.set_num_threads(config.cluster.num_threads)
    one_process = config.model_copy(
        update={"training": config.training.model_copy(update={"backend": "torch", "num_workers": 1})}
    )
    tokenizer = load_tokenizer(config.model)
    prompts = load_prompts(config.data.train_path, config.data, tokenizer)
    tasks = {p.record.get("task", config.env.default_task) for p in prompts} | set(config.env.extra_rewards)
    check_tasks(tasks, config.env)
    with ExitStack() as cleanup:
        start_ray_if_needed(one_process, cleanup)
        envs = build_environments(one_process, tasks, cleanup)
        engine = build_engine(one_process, tokenizer, None, cleanup)
        params, options = prefilter_setup(config)
        rates = measure_pass_rates(prompts, engine, params, tokenizer, envs, options, config.curriculum.success_reward)
    rows = [
        {**p.record, "pass_rate": rate}
        for p, rate in zip(prompts, rates)
        if keep_all or rate < config.curriculum.prefilter_threshold
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(out)
    print(f"pass rates {histogram(rates)}")
    return len(rows), len(prompts)
