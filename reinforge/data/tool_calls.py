"""Tool calls in the policy's text: the Hermes/Qwen convention,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

One parser for everyone who reads the policy's output: the `tool_use` environment, NeMo Gym resources
servers driven by reinforge (envs/gym.py), and the OpenAI-compatible endpoint, which returns the calls
as OpenAI `tool_calls` (serving/). A call may put its JSON on its own lines (Qwen's templates do),
and `arguments` may be an object or a JSON string holding one (OpenAI's wire form).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    """One well-formed call."""

    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """Each `<tool_call>` block of `text`, in order, as a `ToolCall`, or an error string (the
    observation a real tool would give) when the block is malformed."""
    calls: list[ToolCall | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(f"error: the tool call is not valid JSON ({exc.msg})")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append('error: a tool call is {"name": "...", "arguments": {...}}')
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def text_outside_calls(text: str) -> str:
    """`text` without its `<tool_call>` blocks (what an assistant said besides calling tools), stripped."""
    return TOOL_CALL.sub("", text).strip()


def format_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """The Hermes text of one call, as a template without tool-call support would show it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CALL_END
