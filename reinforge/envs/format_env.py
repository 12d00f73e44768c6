"""The format environment: rewards obeying a reasoning switch, as in Llama-Nemotron.

Llama-Nemotron (Bercovich et al. 2025, "Llama-Nemotron: Efficient Reasoning Models",
arXiv:2505.00949) toggles reasoning with the system prompt "detailed thinking on" or "detailed
thinking off". This environment pays 1 when the response obeys the switch, else 0:

- on: after optional leading whitespace the response starts with `<think>`, holds exactly one
  `<think>...</think>` block with non-blank content, and a non-blank answer follows `</think>`.
- off: no `<think>` or `</think>` anywhere, and the response is not blank.

Tags are matched case-sensitively (they are the models' literal special strings). The mode comes
from the record's `thinking` field ("on" or "off") when it has one, else from the conversation's
system messages (the phrase "detailed thinking on"/"off", in any case, anywhere in a system
message); the record wins because it is the dataset's explicit label, while the system prompt may
carry other text. System messages that switch both ways are a DataError. With neither, there is no
format to check and the reward is `no_switch_reward`. The response is the last assistant message;
`info` holds the mode and the violation ("no closing </think>", ...) or None.
"""

from __future__ import annotations

import collections
import re
import threading

from pydantic import Field

from reinforge.config.section import Section
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.errors import DataError

_SWITCH = re.compile(r"\bdetailed thinking (on|off)\b", re.IGNORECASE)
_TAG = re.compile(r"</?think>")
_OPEN, _CLOSE = "<think>", "</think>"


class FormatEnvConfig(Section):
    no_switch_reward: float = Field(default=1.0, ge=0.0, le=1.0)
    """Reward for a conversation with no reasoning switch (no `thinking` field in the record, no
    "detailed thinking on/off" system message): 1 leaves such samples unconstrained."""


def thinking_on_violation(response: str) -> str | None:
    """Why `response` breaks the "detailed thinking on" format, or None if it follows it."""
    text = response.lstrip()
    if not text.startswith(_OPEN):
        return "text before <think>" if _OPEN in text else "no <think> at the start"
    tags = _TAG.findall(text)
    if _CLOSE not in tags:
        return "no closing </think>"
    if tags[1] != _CLOSE:
        return "nested <think>"
    if len(tags) > 2:
        return "more than one think block"
    thought, answer = text[len(_OPEN) :].split(_CLOSE)
    if not thought.strip():
        return "empty think block"
    if not answer.strip():
        return "no answer after </think>"
    return None


def thinking_off_violation(response: str) -> str | None:
    """Why `response` breaks the "detailed thinking off" format, or None if it follows it."""
    if _TAG.search(response):
        return "think tag with thinking off"
    if not response.strip():
        return "empty response"
    return None


def thinking_mode(request: EnvRequest) -> str | None:
    """ "on", "off" or None (no switch): the record's `thinking` field, else the system messages."""
    mode = request.record.get("thinking")
    if mode is not None:
        if mode not in ("on", "off"):
            raise DataError(f"the record field 'thinking' must be 'on' or 'off', got {mode!r}")
        return mode
    switches = {
        switch.lower()
        for message in request.messages
        if message["role"] == "system"
        for switch in _SWITCH.findall(message["content"])
    }
    if len(switches) > 1:
        raise DataError("the system messages say both 'detailed thinking on' and 'detailed thinking off'")
    return switches.pop() if switches else None


class FormatEnv:
    """Scores obedience to the reasoning switch; see the module doc."""

    def __init__(self, config: FormatEnvConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._compliant: collections.Counter[str] = collections.Counter()  # by mode
        self._total: collections.Counter[str] = collections.Counter()

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        modes = [thinking_mode(request) for request in requests]  # data errors before any counting
        responses = []
        for request, mode in zip(requests, modes):
            if mode is None:
                responses.append(EnvResponse(reward=self.config.no_switch_reward, info={"mode": None}))
                with self._lock:
                    self._total["none"] += 1
                continue
            response = _last_assistant_content(request.messages)
            violation = (thinking_on_violation if mode == "on" else thinking_off_violation)(response)
            info = {"mode": mode, "violation": violation}
            responses.append(EnvResponse(reward=float(violation is None), info=info))
            with self._lock:
                self._total[mode] += 1
                self._compliant[mode] += violation is None
        return responses

    def metrics(self) -> dict[str, float]:
        """`compliance_rate/thinking_on` and `/thinking_off` for the modes seen, and `no_switch`
        (samples without a switch), since the last call; then resets."""
        with self._lock:
            metrics = {
                f"compliance_rate/thinking_{mode}": self._compliant[mode] / self._total[mode]
                for mode in ("on", "off")
                if self._total[mode]
            }
            metrics["no_switch"] = float(self._total["none"])
            self._compliant.clear()
            self._total.clear()
        return metrics

    def close(self) -> None:
        pass


def _last_assistant_content(messages: list[dict[str, str]]) -> str:
    for message in reversed(messages):
        if message["role"] == "assistant":
            return message["content"]
    return ""
