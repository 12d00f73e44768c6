"""The IFEval environment: rewards responses that follow verifiable instructions.

A record carries IFEval's fields: `instruction_id_list` (e.g. ["punctuation:no_comma",
"length_constraints:number_words"]) and `kwargs`, a parallel list of keyword dicts
({"relation": "at least", "num_words": 300}); `combination:repeat_prompt` takes its
`prompt_to_repeat` from the kwargs, else from the record's `prompt`. The response is the content of
the last assistant message. Each instruction is checked by its function in `ifeval_checks` (all 25
of IFEval's types; its module doc lists where they differ from IFEval), in IFEval's strict mode: the
response is checked as it is, and a blank response follows no instruction. IFEval's loose mode
(also accepting the response without markdown asterisks or its first or last line) is not offered:
it is an evaluation-time allowance, and as a reward it would pay for the formatting it forgives.

Reward: `reward="all"` pays 1 when every instruction is followed (IFEval's prompt-level accuracy),
`"fraction"` the fraction followed (its instruction-level accuracy, per prompt). Components hold one
1/0 per instruction, keyed by its id; an id that occurs again in the same record (IFEval's data has
"at least 10" and "less than 20" words as two `number_words`) is keyed `<id>#2`, `<id>#3`.
`info["failed"]` lists the keys of the instructions not followed.

A record naming an id that is not implemented, or kwargs that do not fit it, raises a DataError at
the first `step` that sees it; a dataset is never silently scored 0.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Literal

from reinforge.config.section import Section
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.envs.ifeval_checks import bind_instruction
from reinforge.errors import DataError


class IfEvalConfig(Section):
    reward: Literal["all", "fraction"] = "all"
    """`all`: 1 when the response follows every instruction of its record, else 0; `fraction`: the
    fraction of the record's instructions it follows."""


class IfEvalEnv:
    """Scores responses against IFEval instructions; see the module doc."""

    def __init__(self, config: IfEvalConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._followed: collections.Counter[str] = collections.Counter()  # by instruction id
        self._total: collections.Counter[str] = collections.Counter()
        self._num_prompts = 0
        self._num_prompts_followed = 0

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        # Bind every record before scoring any, so a bad record fails the batch before it counts.
        instructions = [_instructions(request.record) for request in requests]
        responses = []
        for request, bound in zip(requests, instructions):
            response = _last_assistant_content(request.messages)
            followed = {key: bool(response.strip()) and check(response) for key, _, check in bound}
            num_followed = sum(followed.values())
            if self.config.reward == "all":
                reward = float(num_followed == len(followed))
            else:
                reward = num_followed / len(followed)
            responses.append(
                EnvResponse(
                    reward=reward,
                    components={key: float(ok) for key, ok in followed.items()},
                    info={"failed": [key for key, ok in followed.items() if not ok]},
                )
            )
            with self._lock:
                for key, instruction_id, _ in bound:
                    self._total[instruction_id] += 1
                    self._followed[instruction_id] += followed[key]
                self._num_prompts += 1
                self._num_prompts_followed += num_followed == len(followed)
        return responses

    def metrics(self) -> dict[str, float]:
        """`follow_rate/<instruction id>` for each id seen, and the prompt- and instruction-level
        follow rates, over the samples since the last call; then resets."""
        with self._lock:
            metrics = {f"follow_rate/{i}": self._followed[i] / self._total[i] for i in sorted(self._total)}
            if self._num_prompts:
                metrics["prompt_follow_rate"] = self._num_prompts_followed / self._num_prompts
                metrics["instruction_follow_rate"] = sum(self._followed.values()) / sum(self._total.values())
            self._followed.clear()
            self._total.clear()
            self._num_prompts = self._num_prompts_followed = 0
        return metrics

    def close(self) -> None:
        pass


def _instructions(record: dict) -> list[tuple[str, str, Callable[[str], bool]]]:
    """(component key, instruction id, bound check) for each instruction of the record."""
    ids, kwargs_list = record.get("instruction_id_list"), record.get("kwargs")
    if not isinstance(ids, list) or not ids or not isinstance(kwargs_list, list):
        raise DataError(
            "IfEvalEnv needs records with a non-empty list 'instruction_id_list' and a list 'kwargs'; "
            f"got keys {sorted(record)}"
        )
    if len(kwargs_list) != len(ids):
        raise DataError(f"'kwargs' has {len(kwargs_list)} entries for {len(ids)} instruction ids: {ids}")
    bound, seen = [], collections.Counter()
    for instruction_id, kwargs in zip(ids, kwargs_list):
        if kwargs is not None and not isinstance(kwargs, dict):
            raise DataError(f"the kwargs of {instruction_id!r} must be a dict, got {kwargs!r}")
        kwargs = dict(kwargs or {})
        if instruction_id == "combination:repeat_prompt" and kwargs.get("prompt_to_repeat") is None:
            kwargs["prompt_to_repeat"] = record.get("prompt")
        seen[instruction_id] += 1
        key = instruction_id if seen[instruction_id] == 1 else f"{instruction_id}#{seen[instruction_id]}"
        bound.append((key, instruction_id, bind_instruction(instruction_id, kwargs)))
    return bound


def _last_assistant_content(messages: list[dict[str, str]]) -> str:
    for message in reversed(messages):
        if message["role"] == "assistant":
            return message["content"]
    return ""
