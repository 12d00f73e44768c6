"""What the endpoint generated during a rollout, so that trajectories are rebuilt from its own record.

An agent's episode is rebuilt from the calls this endpoint answered, never from text the agent sends
back. A call made under an episode's URL (`/episodes/<id>/v1/...`, the `base_url` a Python agent is
handed) is filed under that episode, in order. A call without one (a NeMo Gym agent: Gym's model
server has one fixed base URL) is filed under its tokens: the episode's result lists the token ids of
each of its calls, and each must be a call recorded here (`claim`), whose logprobs are then the ones
the engine sampled with. Identical calls (same prompt, same tokens) are interchangeable: same
policy, same distribution, same logprobs. Several rollouts may record into one recorder at once (in-flight
generation: a prompt group each); `forget` drops what an ended rollout's episodes left and the calls without an
episode that no rollout still open can claim. With router replay each call keeps its routes (the experts the
engine sent its tokens to).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class RecordedCall:
    """One completion as the engine sampled it."""

    prompt_ids: list[int]
    generation_ids: list[int]  # including the stop token when there was one
    logprobs: list[float]  # of each generated token, under the distribution sampled from
    truncated: bool  # stopped by the length limit
    routed_experts: np.ndarray | None = None
    """With the run's router replay: the engine's routes of the call's prompt and generated tokens (all but the
    last generated one), [tokens, MoE layers, top_k] (generation/base.py `Completion.routed_experts`)."""
    token_versions: list[int] | None = None
    """Per generated token, the policy version that sampled it (in-flight generation, `Completion.token_versions`);
    None: the engine did not say."""
    images: Any = None
    """The prompt's images (data/images.py `ImageInputs`: a vision-language model's request with image parts)."""


class CallRecorder:
    """Thread-safe: the endpoint records from its event loop, the rollout takes from its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_episode: dict[str, list[RecordedCall]] = defaultdict(list)
        self._by_tokens: dict[tuple[int, ...], list[tuple[int, RecordedCall]]] = defaultdict(list)
        self._ticks = 0  # calls recorded so far: each call without an episode keeps its number

    def mark(self) -> int:
        """The number of calls recorded so far: those recorded from now on are numbered from it."""
        with self._lock:
            return self._ticks

    def record(self, call: RecordedCall, episode_id: str | None) -> None:
        with self._lock:
            if episode_id is not None:
                self._by_episode[episode_id].append(call)
            else:
                self._by_tokens[_key(call.prompt_ids, call.generation_ids)].append((self._ticks, call))
            self._ticks += 1

    def take_episode(self, episode_id: str) -> list[RecordedCall]:
        """The episode's calls in the order they were answered, forgotten here."""
        with self._lock:
            return self._by_episode.pop(episode_id, [])

    def claim(self, prompt_ids: list[int], generation_ids: list[int]) -> RecordedCall | None:
        """The recorded call with exactly these tokens (forgotten here), or None if this endpoint never made it."""
        with self._lock:
            calls = self._by_tokens.get(_key(prompt_ids, generation_ids))
            if not calls:
                return None
            _, call = calls.pop()
            if not calls:
                del self._by_tokens[_key(prompt_ids, generation_ids)]
            return call

    def forget(self, episode_ids: set[str], before: int | None) -> int:
        """Drop the calls of `episode_ids` and the calls without an episode numbered below `before` (None: none
        of them); returns how many were dropped (made, never taken)."""
        with self._lock:
            left = sum(len(self._by_episode.pop(episode_id, [])) for episode_id in episode_ids)
            if before is not None:
                for key in list(self._by_tokens):
                    kept = [(tick, call) for tick, call in self._by_tokens[key] if tick >= before]
                    left += len(self._by_tokens[key]) - len(kept)
                    if kept:
                        self._by_tokens[key] = kept
                    else:
                        del self._by_tokens[key]
            return left

    def clear(self) -> int:
        """Forget everything (the end of a rollout); returns how many calls nobody took."""
        with self._lock:
            left = sum(map(len, self._by_episode.values())) + sum(map(len, self._by_tokens.values()))
            self._by_episode.clear()
            self._by_tokens.clear()
            return left


def _key(prompt_ids: list[int], generation_ids: list[int]) -> tuple[int, ...]:
    return (len(prompt_ids), *prompt_ids, *generation_ids)
