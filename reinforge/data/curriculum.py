"""Llama-Nemotron's RL data curriculum (Bercovich et al. 2025, arXiv:2505.00949, LN-Ultra's reasoning RL):
a pass-rate pre-filter and a progressive-difficulty prompt sampler (`curriculum.*`, docs/algorithms.md).

Pre-filter: sample k = `prefilter_samples` answers to every training prompt and score them with the
prompt's environment; the pass rate is the fraction of answers whose reward is >= `success_reward` (with
0/1 rewards: the mean reward), a multiple of 1/k. Prompts with pass rate >= `prefilter_threshold` are
dropped. The rates are computed once per run and written atomically to RUN_DIR/curriculum/
(pass_rates.jsonl, one line per prompt, and prefilter.json, the settings that produced them); a resumed
or restarted run with the same settings and prompts reads them back instead of sampling. Records that
carry a `pass_rate` field use it and are never sampled (`reinforge curriculum prefilter` writes them).

Progressive sampler: prompts are binned by pass rate. For batch t the centre c(t) moves linearly from
`start_pass_rate` (t = 0) to `end_pass_rate` (t = num_steps - 1, then stays). Bin b at pass rate v_b gets
weight exp(-(v_b - c)^2 / 2 sigma^2); normalised weights times the open slots, rounded by largest
remainder, are its target count. Each bin gives min(target, what it has left); the shortfall is taken from
the bin with the largest remaining pool, then the next largest, and so on. Within a bin prompts come in a
seeded shuffled order, without replacement: one pass over every bin is an epoch, after which all bins
refill (a batch may straddle two epochs). The batch is then shuffled.

Deviations from the paper: (1) the pass rates come from the initial policy being trained, not from
another model (LN-Super scored LN-Ultra's data there); `reinforge curriculum prefilter` with another
`model.name_or_path` gives the paper's setup. (2) The paper does not say how bins, targets and rounding
are defined; the above is our reading (equal-width bins with `num_bins`, else one per distinct pass rate;
bins without prompts take no share). (3) The centre moves per drawn batch, so DAPO's dynamic sampling,
which draws extra batches in a step, moves it faster than the step count.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from reinforge.data.prompts import Prompt, PromptSampler
from reinforge.errors import DataError
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.rollout.rollout import RolloutOptions, rollout
from reinforge.run_dir import atomic_directory

if TYPE_CHECKING:
    from reinforge.config import Config
    from reinforge.envs.base import Environment

PASS_RATES_FILE = "pass_rates.jsonl"
SETTINGS_FILE = "prefilter.json"
PROMPTS_PER_ROLLOUT = 256  # prompts per rollout call of the pre-filter (a constant: the samples depend on it)
PREFILTER_SEED_OFFSET = 700_001  # a sampling stream apart from the training steps' (seed * 1_000_003 + step)


def measure_pass_rates(prompts: list[Prompt], engine: GenerationBackend, params: SamplingParams, tokenizer,
                       envs: dict[str, Environment], options: RolloutOptions, success_reward: float,
                       console_print: Callable[[str], None] = print) -> list[float]:
    """Each prompt's fraction of `params.num_samples` sampled answers with reward >= `success_reward`."""
    pass_rates: list[float] = []
    for index, start in enumerate(range(0, len(prompts), PROMPTS_PER_ROLLOUT)):
        chunk = prompts[start : start + PROMPTS_PER_ROLLOUT]
        chunk_params = replace(params, seed=params.seed + 104_729 * index)
        passed = [0] * len(chunk)
        for trajectory in rollout(chunk, engine, chunk_params, tokenizer, envs, options):
            passed[trajectory.group] += trajectory.reward >= success_reward
        pass_rates += [count / params.num_samples for count in passed]
        console_print(f"curriculum pre-filter: {len(pass_rates)}/{len(prompts)} prompts sampled")
    return pass_rates


def prefilter_setup(config: Config) -> tuple[SamplingParams, RolloutOptions]:
    """The pre-filter's sampling (the training rollouts' settings, k samples, its own seed) and rollout options."""
    gen, cur, g = config.generation, config.curriculum, config.grpo
    params = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=cur.prefilter_temperature or gen.temperature,
                            top_p=gen.top_p, top_k=gen.top_k, stop_strings=tuple(gen.stop_strings),
                            num_samples=cur.prefilter_samples, seed=config.seed * 1_000_003 + PREFILTER_SEED_OFFSET)
    options = RolloutOptions(default_task=config.env.default_task, max_turns=g.max_turns, turn_reward=g.turn_reward,
                             max_observation_tokens=g.max_observation_tokens, extra_rewards=config.env.extra_rewards)
    return params, options


def prefilter_settings(config: Config, prompts: list[Prompt]) -> dict[str, Any]:
    """What the stored pass rates depend on; stored rates are reused only when all of it is unchanged."""
    params, options = prefilter_setup(config)
    digest = hashlib.sha256(json.dumps([[p.token_ids, p.record] for p in prompts], sort_keys=True).encode()).hexdigest()
    sampling = {**asdict(params), "stop_strings": list(params.stop_strings), "stop_token_ids": list(params.stop_token_ids)}
    engine = {"backend": config.generation.backend, "max_batch_size": config.generation.max_batch_size}
    return {"model": config.model.model_dump(mode="json"), "engine": engine, "sampling": sampling, "rollout": asdict(options),
            "success_reward": config.curriculum.success_reward, "prompts_sha256": digest}


def record_pass_rates(prompts: list[Prompt]) -> list[float] | None:
    """The records' own `pass_rate` fields, when every record has one; None when none has."""
    rates = [p.record.get("pass_rate") for p in prompts]
    if all(rate is None for rate in rates):
        return None
    for index, rate in enumerate(rates):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise DataError(f"training record {index} has pass_rate={rate!r}; give every record a pass_rate in [0, 1], "
                            "or none (curriculum.prefilter=true then measures them)")
    return [float(rate) for rate in rates]


def pass_rates_for(config: Config, prompts: list[Prompt], engine: GenerationBackend | None, tokenizer,
                   envs: dict[str, Environment], run_dir: Path, console_print: Callable[[str], None] = print) -> list[float]:
    """The training prompts' pass rates: the records', else the run's stored ones, else sampled now and stored."""
    rates = record_pass_rates(prompts)
    if rates is not None:
        return rates
    if not config.curriculum.prefilter:
        raise DataError("curriculum.sampler=progressive needs pass rates: set curriculum.prefilter=true, or give every record "
                        "of data.train_path a pass_rate field (`reinforge curriculum prefilter` writes them)")
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
    rates = measure_pass_rates(prompts, engine, params, tokenizer, envs, options, config.curriculum.success_reward, console_print)
    counters = {f"{task}/{name}": value for task, env in envs.items() for name, value in env.metrics().items() if value}
    if counters:  # drained so that step 1's env metrics count step 1 only
        console_print(f"curriculum pre-filter: environment counters {counters}")
    with atomic_directory(directory) as tmp:
        (tmp / PASS_RATES_FILE).write_text("".join(
            json.dumps({"index": i, "prompt": p.messages[-1]["content"], "pass_rate": rate,
                        "num_passed": round(rate * params.num_samples), "num_samples": params.num_samples}) + "\n"
            for i, (p, rate) in enumerate(zip(prompts, rates))))
        (tmp / SETTINGS_FILE).write_text(json.dumps({"settings": settings, "histogram": histogram(rates)}, indent=1))
    return rates


def histogram(rates: list[float]) -> dict[str, int]:
    """Prompts per pass rate (per tenth when there are more than 20 distinct rates)."""
    if len(set(rates)) > 20:
        return {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": n for b, n in sorted(Counter(min(int(r * 10), 9) for r in rates).items())}
    return {f"{rate:.3f}": n for rate, n in sorted(Counter(rates).items())}


def gaussian_targets(bin_values: list[float], centre: float, sigma: float, num_slots: int) -> list[int]:
    """Slots per bin: the Gaussian's normalised weights times `num_slots`, rounded by largest remainder
    (ties: the heavier bin, then the lower index), so that they sum to `num_slots`."""
    nearest = min((value - centre) ** 2 for value in bin_values)  # divided out, so that far bins cannot underflow all
    weights = [math.exp(-((value - centre) ** 2 - nearest) / (2 * sigma**2)) for value in bin_values]
    total = sum(weights)
    quotas = [num_slots * w / total for w in weights]
    targets = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda b: (-(quotas[b] - targets[b]), -weights[b], b))
    for b in by_remainder[: num_slots - sum(targets)]:
        targets[b] += 1
    return targets


class ProgressiveSampler:
    """Batches whose pass rates follow a Gaussian moving from easy to hard (see the module docstring).

    Same interface as `PromptSampler`; `state_dict()` is JSON-serialisable and holds all its state: every
    random order is re-derived from (seed, epoch) or (seed, batch index), so it stores no RNG state itself.
    """

    def __init__(self, prompts: list[Prompt], pass_rates: list[float], batch_size: int, seed: int, num_steps: int,
                 start_pass_rate: float, end_pass_rate: float, sigma: float, num_bins: int | None = None):
        assert prompts and len(prompts) == len(pass_rates)
        self.prompts, self.pass_rates, self.batch_size, self.seed = prompts, pass_rates, batch_size, seed
        self.num_steps, self.start, self.end, self.sigma = num_steps, start_pass_rate, end_pass_rate, sigma
        if num_bins is None:
            keys, value_of = list(pass_rates), {rate: rate for rate in pass_rates}
        else:
            keys = [min(int(rate * num_bins + 1e-9), num_bins - 1) for rate in pass_rates]
            value_of = {key: (key + 0.5) / num_bins for key in keys}
        order = sorted(set(keys))
        self.bin_values = [value_of[key] for key in order]
        self.bins = [[i for i, key in enumerate(keys) if key == k] for k in order]  # prompt indices per bin
        self.step, self.epoch = 0, 0  # batches drawn so far; epochs completed
        self.taken = [0] * len(self.bins)  # prompts drawn from each bin in this epoch
        self._pools = self._epoch_pools()
        self._last: dict[str, float] = {}

    def _epoch_pools(self) -> list[list[int]]:
        pools = [list(indices) for indices in self.bins]
        for b, pool in enumerate(pools):
            random.Random(f"curriculum/{self.seed}/{self.epoch}/{b}").shuffle(pool)
        return pools

    def target_pass_rate(self) -> float:
        """The Gaussian's centre for the next batch."""
        progress = min(self.step / (self.num_steps - 1), 1.0) if self.num_steps > 1 else 0.0
        return self.start + (self.end - self.start) * progress

    def _take(self, b: int, count: int) -> list[int]:
        count = min(count, len(self._pools[b]) - self.taken[b])
        taken = self._pools[b][self.taken[b] : self.taken[b] + count]
        self.taken[b] += count
        return taken

    def next_batch(self) -> list[Prompt]:
        centre, batch, num_shortfall = self.target_pass_rate(), [], 0
        while len(batch) < self.batch_size:
            remaining = [len(pool) - taken for pool, taken in zip(self._pools, self.taken)]
            if not any(remaining):  # one pass over every bin: a new epoch
                self.epoch, self.taken = self.epoch + 1, [0] * len(self.bins)
                self._pools = self._epoch_pools()
                continue
            targets = gaussian_targets(self.bin_values, centre, self.sigma, self.batch_size - len(batch))
            for b, target in enumerate(targets):
                batch += self._take(b, target)
            left = [len(pool) - taken for pool, taken in zip(self._pools, self.taken)]
            by_size = sorted(range(len(self.bins)), key=lambda b: (-left[b], abs(self.bin_values[b] - centre), b))
            for b in by_size:  # the shortfall, from the largest remaining pools (ties: nearest the centre)
                shortfall = self._take(b, self.batch_size - len(batch))
                batch, num_shortfall = batch + shortfall, num_shortfall + len(shortfall)
        random.Random(f"curriculum-batch/{self.seed}/{self.step}").shuffle(batch)
        self._last = {
            "curriculum/target_pass_rate": centre,
            "curriculum/batch_pass_rate_mean": sum(self.pass_rates[i] for i in batch) / len(batch),
            "curriculum/shortfall_fraction": num_shortfall / len(batch),
            "curriculum/epoch": self.epoch,
        }
        self.step += 1
        return [self.prompts[i] for i in batch]

    def last_batch_metrics(self) -> dict[str, float]:
        """The last batch's target centre, mean pass rate, fraction taken as shortfall, and epoch."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "taken": list(self.taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["taken"]) != len(self.bins) or any(t > len(b) for t, b in zip(state["taken"], self.bins)):
            raise DataError("the checkpoint's curriculum sampler state does not fit these prompts' pass-rate bins; "
                            "resume with the same data and pass rates, or start a new run")
        self.step, self.epoch, self.taken = state["step"], state["epoch"], list(state["taken"])
        self._pools = self._epoch_pools()


def build_prompt_sampler(config: Config, train_prompts: list[Prompt], engine: GenerationBackend | None, tokenizer,
                         envs: dict[str, Environment], run_dir: Path, console_print: Callable[[str], None] = print,
                         ) -> tuple[PromptSampler | ProgressiveSampler, dict[str, float]]:
    """The run's prompt sampler and the curriculum's one-off metrics ({} with the curriculum off): a plain
    `PromptSampler` unless `curriculum.prefilter` or `curriculum.sampler=progressive` asks for more."""
    cur, g = config.curriculum, config.grpo
    if not cur.prefilter and cur.sampler == "uniform":
        return PromptSampler(train_prompts, g.num_prompts_per_step, config.seed, config.data.shuffle), {}
    rates = pass_rates_for(config, train_prompts, engine, tokenizer, envs, run_dir, console_print)
    keep = [i for i, rate in enumerate(rates) if not cur.prefilter or rate < cur.prefilter_threshold]
    if not keep:
        raise DataError(f"every training prompt has a pass rate >= curriculum.prefilter_threshold={cur.prefilter_threshold}; "
                        "raise the threshold or train on harder prompts")
    console_print(f"curriculum: pass rates of {len(rates)} prompts {histogram(rates)}; kept {len(keep)}"
                  + (f" below {cur.prefilter_threshold}" if cur.prefilter else ""))
    prompts, kept_rates = [train_prompts[i] for i in keep], [rates[i] for i in keep]
    metrics = {
        "curriculum/num_prompts_kept": len(keep),
        "curriculum/prefilter_dropped_fraction": 1 - len(keep) / len(rates),
        "curriculum/kept_pass_rate_mean": sum(kept_rates) / len(kept_rates),
    }
    if cur.sampler == "uniform":
        return PromptSampler(prompts, g.num_prompts_per_step, config.seed, config.data.shuffle), metrics
    sampler = ProgressiveSampler(prompts, kept_rates, g.num_prompts_per_step, config.seed, cur.num_steps or g.max_steps,
                                 cur.start_pass_rate, cur.end_pass_rate, cur.sigma, cur.num_bins)
    return sampler, metrics


def batch_metrics(sampler: PromptSampler | ProgressiveSampler) -> dict[str, float]:
    """The last drawn batch's curriculum metrics ({} for a plain `PromptSampler`). Under dynamic sampling, the
    last round's."""
    return sampler.last_batch_metrics() if isinstance(sampler, ProgressiveSampler) else {}


def prefilter_file(config: Config, out: Path, keep_all: bool) -> tuple[int, int]:
    """`reinforge curriculum prefilter`: measure the pass rates of data.train_path's prompts with the config's model
    and engine in this process, and write the records with a `pass_rate` field to `out` (those below the
    threshold, or all with `keep_all`). Returns (records written, prompts measured)."""
    from contextlib import ExitStack

    import torch

    from reinforge.algorithms.builders import build_engine, build_environments, start_ray_if_needed
    from reinforge.data.prompts import load_prompts
    from reinforge.envs.registry import check_tasks
    from reinforge.modeling import load_tokenizer

    if config.cluster.num_threads:
        torch.set_num_threads(config.cluster.num_threads)
    one_process = config.model_copy(update={"training": config.training.model_copy(update={"backend": "torch", "num_workers": 1})})
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
    rows = [{**p.record, "pass_rate": rate} for p, rate in zip(prompts, rates)
            if keep_all or rate < config.curriculum.prefilter_threshold]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(out)
    print(f"pass rates {histogram(rates)}")
    return len(rows), len(prompts)
