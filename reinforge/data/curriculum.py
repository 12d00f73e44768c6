"""Llama-Nemotron's progressive-difficulty prompt sampler (Bercovich et al. 2025, arXiv:2505.00949, LN-Ultra's
reasoning RL; `curriculum.*`, docs/algorithms.md). The pass rates it bins by come from the records' own
`pass_rate` fields or from the pre-filter that samples them (reinforge/loops/curriculum_prefilter.py).

Progressive sampler: prompts are binned by pass rate. For batch t the centre c(t) moves linearly from
`start_pass_rate` (t = 0) to `end_pass_rate` (t = num_steps - 1, then stays). Bin b at pass rate v_b gets
weight exp(-(v_b - c)^2 / 2 sigma^2); normalised weights times the open slots, rounded by largest
remainder, are its target count. Each bin gives min(target, what it has left); the shortfall is taken from
the bin with the largest remaining pool, then the next largest, and so on. Within a bin prompts come in a
seeded shuffled order, without replacement: one pass over every bin is an epoch, after which all bins
refill (a batch may straddle two epochs). The batch is then shuffled.

Deviations from the paper: (1) the paper does not say how bins, targets and rounding are defined; the above
is our reading (equal-width bins with `num_bins`, else one per distinct pass rate; bins without prompts take
no share). (2) The centre moves per drawn batch, so DAPO's dynamic sampling, which draws extra batches in a
step, moves it faster than the step count.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any, Literal

from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.data.prompts import Prompt, PromptSampler
from reinforge.errors import DataError


class CurriculumConfig(Section):
    """Llama-Nemotron's RL data curriculum (arXiv:2505.00949): a pass-rate pre-filter and a sampler that
    moves from easy to hard prompts. Implemented in reinforge/loops/curriculum_prefilter.py (the pre-filter)
    and reinforge/data/curriculum.py (the sampler); docs/algorithms.md."""

    prefilter: bool = False
    """Before training, sample `prefilter_samples` answers to every training prompt with the initial policy
    and drop the prompts whose pass rate is at least `prefilter_threshold`. The pass rates are stored in
    RUN_DIR/curriculum/pass_rates.jsonl and reused on resume; records that carry a `pass_rate` field
    (`reinforge curriculum prefilter` writes them) are not sampled again."""
    prefilter_samples: int = 8
    """Answers sampled per prompt to measure its pass rate (k); pass rates are then multiples of 1/k."""
    prefilter_threshold: float = 0.75
    """Prompts with pass rate >= this are dropped: the policy already solves them."""
    prefilter_temperature: float | None = None
    """Sampling temperature of the pre-filter; null: generation.temperature."""
    success_reward: float = 1.0
    """A sampled answer passes when its reward is at least this; with 0/1 rewards (math, code) the pass
    rate is the mean reward. Lower it for graded rewards (a judge's scores)."""
    sampler: Literal["uniform", "progressive"] = "uniform"
    """`uniform`: shuffled epochs (data.shuffle) over the kept prompts; `progressive`: each batch follows a
    Gaussian over pass rate whose centre moves from `start_pass_rate` to `end_pass_rate` (needs pass rates:
    `prefilter=true`, or a `pass_rate` field in every record)."""
    num_bins: int | None = None
    """Pass-rate bins of the progressive sampler: null: one bin per distinct pass rate (with the pre-filter,
    the multiples of 1/k); N: N equal-width bins over [0, 1], each at its centre (empty ones are left out)."""
    sigma: float = 0.15
    """Width (standard deviation, in pass rate) of the progressive sampler's Gaussian target."""
    start_pass_rate: float = 0.75
    """Centre of the Gaussian for the first batch (easy: a high pass rate)."""
    end_pass_rate: float = 0.0
    """Centre of the Gaussian from batch `num_steps` on (hard: a low pass rate)."""
    num_steps: int | None = None
    """Batches over which the centre moves linearly from start to end; null: loop.max_steps. Dynamic
    sampling draws extra batches in a step, which move the centre too."""

    @model_validator(mode="after")
    def _check(self) -> "CurriculumConfig":
        checks = [
            (self.prefilter_samples >= 1, "curriculum.prefilter_samples must be >= 1 (8 in Llama-Nemotron)"),
            (
                0 < self.prefilter_threshold <= 1,
                "curriculum.prefilter_threshold must be in (0, 1]: prompts with a pass rate at or above it are dropped",
            ),
            (
                self.prefilter_temperature is None or self.prefilter_temperature > 0,
                "curriculum.prefilter_temperature must be > 0 (or null for generation.temperature)",
            ),
            (
                self.num_bins is None or self.num_bins >= 1,
                "curriculum.num_bins must be >= 1 (or null: one bin per distinct pass rate)",
            ),
            (self.sigma > 0, "curriculum.sigma must be > 0 (the Gaussian's width in pass rate, e.g. 0.15)"),
            (
                0 <= self.start_pass_rate <= 1 and 0 <= self.end_pass_rate <= 1,
                "curriculum.start_pass_rate and curriculum.end_pass_rate must be in [0, 1]",
            ),
            (
                self.num_steps is None or self.num_steps >= 1,
                "curriculum.num_steps must be >= 1 (or null: loop.max_steps)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


def record_pass_rates(prompts: list[Prompt]) -> list[float] | None:
    """The records' own `pass_rate` fields, when every record has one; None when none has."""
    rates = [p.record.get("pass_rate") for p in prompts]
    if all(rate is None for rate in rates):
        return None
    for index, rate in enumerate(rates):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise DataError(
                f"training record {index} has pass_rate={rate!r}; give every record a pass_rate in [0, 1], "
                "or none (curriculum.prefilter=true then measures them)"
            )
    return [float(rate) for rate in rates]


def histogram(rates: list[float]) -> dict[str, int]:
    """Prompts per pass rate (per tenth when there are more than 20 distinct rates)."""
    if len(set(rates)) > 20:
        return {
            f"{b / 10:.1f}-{(b + 1) / 10:.1f}": n
            for b, n in sorted(Counter(min(int(r * 10), 9) for r in rates).items())
        }
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

    def __init__(
        self,
        prompts: list[Prompt],
        pass_rates: list[float],
        batch_size: int,
        seed: int,
        num_steps: int,
        start_pass_rate: float,
        end_pass_rate: float,
        sigma: float,
        num_bins: int | None = None,
    ):
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

    @property
    def drawn(self) -> int:
        """Prompts drawn so far: the next prompt's ordinal in the data stream."""
        return self.step * self.batch_size

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
        """The position of `state_dict`; without `taken`, the epoch starts afresh (a data order restarted on another
        file, loops/checkpointing.py: the schedule goes on at `step`)."""
        state = {"taken": [0] * len(self.bins)} | state
        if len(state["taken"]) != len(self.bins) or any(t > len(b) for t, b in zip(state["taken"], self.bins)):
            raise DataError(
                "the checkpoint's curriculum sampler state does not fit these prompts' pass-rate bins; "
                "resume with the same data and pass rates, or start a new run"
            )
        self.step, self.epoch, self.taken = state["step"], state["epoch"], list(state["taken"])
        self._pools = self._epoch_pools()


def batch_metrics(sampler: PromptSampler | ProgressiveSampler) -> dict[str, float]:
    """The last drawn batch's curriculum metrics ({} for a plain `PromptSampler`). Under dynamic sampling, the
    last round's."""
    return sampler.last_batch_metrics() if isinstance(sampler, ProgressiveSampler) else {}
