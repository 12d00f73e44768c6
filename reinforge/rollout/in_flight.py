"""In-flight rollouts (`rollout.mode=in_flight`): generation that never waits for training.

A pool of prompts (`rollout.in_flight_pool_groups`) is always being generated: one worker thread per slot takes
the next prompt, runs its group of episodes through the run's `InFlightEngine` (generation/in_flight.py: the
workers' calls join one running batch), and queues the scored group in the order groups finish. `get(step)` takes
the first `rollout.num_prompts_per_step` finished groups, so a long sequence holds back only its own group. The
refit lands in the engine between two decoding steps while the workers keep generating, so a trajectory may hold
tokens of several policy versions (`Trajectory.token_versions`); its `policy_version` is its oldest token's.

Staleness: the policy about to train at step s is version s - 1. A group whose oldest token is older than
s - 1 - `rollout.max_staleness` is never trained on: its prompt is generated again, first in line
(`rollout/in_flight_regenerated`), so no prompt is lost.

Checkpoints: `snapshot` saves the finished groups not yet trained on and every prompt drawn without a finished
group (waiting, in flight, or to be generated again) with its ordinal; a resumed run trains the first and
generates the others again before drawing new prompts, so no prompt is lost and none is trained twice. Which
version samples which token depends on timing, so an in-flight run is not bitwise reproducible.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from reinforge.data.batch import Trajectory
from reinforge.data.prompts import Prompt
from reinforge.hang import HangError
from reinforge.logging.metrics import Timers
from reinforge.rollout.source import RolloutBatch

# ordinal, prompt -> the group's scored trajectories and its metrics (timing/*, summed over a step's groups)
ProduceGroup = Callable[[int, Prompt], tuple[list[Trajectory], dict[str, float]]]


@dataclass
class InFlightPending:
    """What a checkpoint keeps of in-flight rollouts (module docstring)."""

    ready: list[tuple[int, Prompt, list[Trajectory]]] = field(default_factory=list)  # finished, in that order
    redo: list[tuple[int, Prompt]] = field(default_factory=list)  # drawn, without a finished group


def oldest_version(group: list[Trajectory]) -> int:
    return min(min(t.token_versions) if t.token_versions else t.policy_version for t in group)


class InFlightRollouts:
    def __init__(
        self,
        produce_group: ProduceGroup,
        sampler,
        num_prompts: int,
        pool: int,
        max_staleness: int,
        pending: list[InFlightPending] = (),
        wait_timeout_s: float = 1800.0,
        counters: Callable[[list[Trajectory]], dict[str, float]] = lambda trajectories: {},
    ):
        self.produce_group, self.sampler, self.num_prompts = produce_group, sampler, num_prompts
        self.max_staleness, self.wait_timeout_s, self.counters = max_staleness, wait_timeout_s, counters
        saved = pending[0] if pending else InFlightPending()
        self._ready: deque[tuple[int, Prompt, list[Trajectory], dict[str, float]]] = deque(
            (ordinal, prompt, group, {}) for ordinal, prompt, group in saved.ready
        )
        self._todo: deque[tuple[int, Prompt]] = deque(saved.redo)  # to generate, in order, before new draws
        self._in_flight: dict[int, Prompt] = {}
        self._capacity = pool
        self._regenerated = 0
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name=f"reinforge-in-flight-{i}", daemon=True) for i in range(pool)
        ]
        for thread in self._threads:
            thread.start()

    # -- the workers --

    def _next_prompt(self) -> tuple[int, Prompt]:
        """The next prompt to generate (holding the condition): one to redo, else the sampler's next."""
        if not self._todo:
            first = self.sampler.drawn
            self._todo.extend((first + i, prompt) for i, prompt in enumerate(self.sampler.next_batch()))
        ordinal, prompt = self._todo.popleft()
        self._in_flight[ordinal] = prompt
        return ordinal, prompt

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or len(self._ready) + len(self._in_flight) < self._capacity)
                if self._stopping:
                    return
                ordinal, prompt = self._next_prompt()
            try:
                group, metrics = self.produce_group(ordinal, prompt)
            except BaseException as error:  # handed to the trainer's thread, which raises it
                with self._cond:
                    self._error = self._error or error
                    self._cond.notify_all()
                return
            with self._cond:
                del self._in_flight[ordinal]
                self._ready.append((ordinal, prompt, group, metrics))
                self._cond.notify_all()

    # -- the trainer's side --

    def _requeue_stale(self, step: int) -> None:
        """Groups too old to train on at `step` go back to be generated again, first in line."""
        oldest_allowed = step - 1 - self.max_staleness
        stale = [item for item in self._ready if oldest_version(item[2]) < oldest_allowed]
        if stale:
            self._ready = deque(item for item in self._ready if oldest_version(item[2]) >= oldest_allowed)
            self._todo.extendleft(reversed([(ordinal, prompt) for ordinal, prompt, _, _ in stale]))
            self._regenerated += len(stale)
            self._cond.notify_all()

    def get(self, step: int, timers: Timers | None = None) -> RolloutBatch:
        """The first `num_prompts` finished groups fresh enough for `step` (timing/rollout_wait_s: the wait)."""
        deadline = time.monotonic() + self.wait_timeout_s
        with (timers or Timers()).time("rollout_wait"), self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                self._requeue_stale(step)
                if len(self._ready) >= self.num_prompts:
                    break
                if not self._cond.wait(timeout=max(deadline - time.monotonic(), 0)) and time.monotonic() > deadline:
                    what = f"{self.num_prompts} finished groups for step {step}"
                    raise HangError(
                        "in-flight rollouts", what, self.wait_timeout_s, "deadlines.rollout_wait_s"
                    ).capture()
            taken = [self._ready.popleft() for _ in range(self.num_prompts)]
            regenerated, self._regenerated = self._regenerated, 0
            self._cond.notify_all()
        trajectories, metrics = [], {}
        for index, (_, _, group, group_metrics) in enumerate(taken):
            for trajectory in group:
                trajectory.group = index
                trajectory.policy_version = oldest_version([trajectory])
            trajectories += group
            for name, value in group_metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        metrics |= version_metrics(step, trajectories) | self.counters(trajectories)
        metrics["rollout/in_flight_regenerated"] = float(regenerated)
        return RolloutBatch(step, trajectories, metrics, min(t.policy_version for t in trajectories))

    @contextmanager
    def engine_turn(self, version: int, timers: Timers) -> Iterator[None]:
        """Nothing to wait for: the refit, probes and validation go to the engine while the workers generate."""
        yield

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            ready = [(ordinal, prompt, group) for ordinal, prompt, group, _ in self._ready]
            redo = sorted(self._in_flight.items()) + list(self._todo)
            return {"sampler": self.sampler.state_dict(), "pending": [InFlightPending(ready, redo)]}

    def close(self, timeout_s: float = 60.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))


def version_metrics(step: int, trajectories: list[Trajectory]) -> dict[str, float]:
    """How old the tokens of a step's batch are (docs/metrics.md): token staleness (step - 1 - the token's version)
    mean and max over response tokens, distinct versions per sequence, and the share of sequences that span an
    update."""
    staleness, versions_per_sequence = [], []
    for trajectory in trajectories:
        versions = trajectory.token_versions or [trajectory.policy_version] * len(trajectory.response_ids)
        staleness += [step - 1 - version for version in versions]
        versions_per_sequence.append(len(set(versions)) or 1)
    return {
        "rollout/token_staleness_mean": sum(staleness) / max(len(staleness), 1),
        "rollout/token_staleness_max": float(max(staleness, default=0)),
        "rollout/versions_per_sequence_mean": sum(versions_per_sequence) / len(versions_per_sequence),
        "rollout/spanning_update_fraction": sum(n > 1 for n in versions_per_sequence) / len(versions_per_sequence),
    }
