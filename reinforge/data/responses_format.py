"""Chat messages to and from OpenAI Responses shapes, as NeMo Gym 0.7.0 uses them in a resources server's
`/verify` request and an agent's results (Gym's own translation is `nemo_gym/responses_converter.py`).

Three conversions, all pure (no I/O), all on plain dicts:

- `create_params_to_chat(params)`: a Gym row's `responses_create_params` -> (chat messages, chat-form
  tools). `input` is a string (one user message) or a list of items: messages (`{"role", "content"}`,
  with or without `"type": "message"`, content a string or a list of text parts), `function_call`,
  `function_call_output` and `reasoning` items. `instructions` becomes a leading system message.
- `items_to_chat(items)`: the item list alone; used for a Gym `response.output` too (the env server).
  As in Gym, an assistant message, the `function_call`s and the `reasoning` (as `<think>...</think>`
  in front of the content) that follow one another make one assistant chat message with OpenAI
  `tool_calls`; a `function_call_output` is a `tool` message with its `tool_call_id`.
- `chat_to_response(messages, ...)`: the policy's side of a conversation (the messages after the
  prompt) -> a Responses `response` object that Gym's `/verify` accepts. An assistant message
  becomes a `message` item (`output_text`) for its text, then one `function_call` item per call,
  taken from OpenAI `tool_calls` when it has them, else from its `<tool_call>` blocks (Hermes). A
  `tool` message becomes a `function_call_output` answering its `tool_call_id`, or without one the
  next call of the assistant message before it, in order (how reinforge's rollout appends tool
  results). Ids are deterministic: `msg_<n>`, and `call_<n>` for calls that carry none.

Limits: only text content (an image part is a DataError); a malformed `<tool_call>` block (bad
JSON, no name) is no call: it stays in the message text, as vLLM's Hermes parser leaves it, and
the `tool` message answering it (the error shown to the policy) has no call to answer and is left
out. `<think>` text stays inside the message (no `reasoning` items are made).
"""

from __future__ import annotations

import json
from typing import Any

from reinforge.data.images import has_image_parts
from reinforge.data.templates import chat_tools, content_text
from reinforge.data.tool_calls import TOOL_CALL, ToolCall, format_tool_call, parse_tool_calls
from reinforge.errors import DataError

MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def create_params_to_chat(params: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The chat messages and chat-form tools of a row's `responses_create_params`."""
    if not isinstance(params, dict) or "input" not in params:
        raise DataError("responses_create_params must be an object with an `input` (a string or a list of items)")
    items = params["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list):
        raise DataError(
            f"responses_create_params.input must be a string or a list of items, got {type(items).__name__}"
        )
    messages = items_to_chat(items)
    instructions = params.get("instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": str(instructions)})
    return messages, chat_tools(params.get("tools"))


def items_to_chat(items: list[Any]) -> list[dict[str, Any]]:
    """Responses items (input or output) as chat messages; see the module doc."""
    messages: list[dict[str, Any]] = []
    assistant: dict[str, Any] | None = None  # the assistant message being gathered
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ("message", "function_call", "reasoning") and (kind != "message" or item.get("role") == "assistant"):
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                messages.append(assistant)
            _gather(assistant, kind, item)
            continue
        assistant = None
        if kind == "message" and item.get("role") in MESSAGE_ROLES:
            content = item.get("content")  # with images, its parts as they are (data/images.py renders them)
            messages.append(
                {"role": item["role"], "content": content if has_image_parts(content) else content_text(content)}
            )
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) or has_image_parts(output) else content_text(output),
                }
            )
        else:
            raise DataError(
                f"Responses item not supported (only messages, function_call, function_call_output and "
                f"reasoning): {json.dumps(item)[:100]}"
            )
    return messages


def _gather(assistant: dict[str, Any], kind: str, item: dict[str, Any]) -> None:
    """Add a message, function_call or reasoning item to the assistant message of its turn."""
    if kind == "message":
        assistant["content"] += content_text(item.get("content"))
    elif kind == "reasoning":
        texts = [part.get("text", "") for part in item.get("summary") or [] if isinstance(part, dict)]
        assistant["content"] += "".join(f"<think>{text}</think>" for text in texts if text)
    else:
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise DataError(f"a function_call item needs a name and a call_id: {json.dumps(item)[:100]}")
        arguments = item.get("arguments", "{}")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {
                "name": item["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            },
        }
        assistant.setdefault("tool_calls", []).append(call)


def hermes_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as reinforge's own environments read them: string content, an assistant's OpenAI
    `tool_calls` written after its text as `<tool_call>` blocks, `tool` messages as role and content."""
    out = []
    for message in messages:
        content = content_text(message.get("content"))
        for call in message.get("tool_calls") or []:
            content += format_tool_call(call["function"]["name"], call["function"]["arguments"])
        out.append({"role": message["role"], "content": content})
    return out


def chat_to_response(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    model: str,
    response_id: str,
    parallel_tool_calls: bool = True,
    tool_choice: Any = "auto",
) -> dict[str, Any]:
    """The Responses object for the policy's side of a conversation (see the module doc); `tools`: the
    row's tools in Responses form, as Gym echoes them."""
    output: list[dict[str, Any]] = []
    pending: list[str | None] = []  # call ids the next tool messages answer, in order (None: a malformed call)
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            text, calls = _assistant_calls(message, first_number=_num_calls(output) + 1)
            if text or not calls:
                output.append(
                    {
                        "id": f"msg_{len(output) + 1}",
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}],
                    }
                )
            output += [call for call in calls if call is not None]
            pending = [call["call_id"] if call else None for call in calls]
        elif role == "tool":
            call_id = message.get("tool_call_id") or (pending.pop(0) if pending else None)
            if call_id:
                output.append(
                    {"type": "function_call_output", "call_id": call_id, "output": content_text(message.get("content"))}
                )
        elif role in MESSAGE_ROLES:
            output.append({"type": "message", "role": role, "content": content_text(message.get("content"))})
        else:
            raise DataError(f"a message with role {role!r} cannot go into a Responses object")
    return {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "model": model,
        "output": output,
        "parallel_tool_calls": parallel_tool_calls,
        "tool_choice": tool_choice,
        "tools": tools or [],
    }


def _assistant_calls(message: dict[str, Any], first_number: int) -> tuple[str, list[dict[str, Any] | None]]:
    """(the message's text, its calls as function_call items; None for each malformed `<tool_call>` block)."""
    text = content_text(message.get("content"))
    if message.get("tool_calls"):
        calls = []
        for number, call in enumerate(message["tool_calls"], start=first_number):
            function = call.get("function", {})
            arguments = function.get("arguments", "{}")
            calls.append(
                _function_call(
                    call.get("id") or f"call_{number}",
                    function.get("name", ""),
                    arguments if isinstance(arguments, str) else json.dumps(arguments),
                )
            )
        return text, calls
    parsed = [(block, parse_tool_calls(block.group(0))[0]) for block in TOOL_CALL.finditer(text)]
    if not parsed:
        return text, []
    kept, end, calls, number = [], 0, [], first_number
    for block, call in parsed:
        if isinstance(call, ToolCall):
            kept.append(text[end : block.start()])
            end = block.end()
            calls.append(_function_call(f"call_{number}", call.name, call.arguments_json()))
            number += 1
        else:
            calls.append(None)
    return ("".join(kept) + text[end:]).strip(), calls


def _function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": "completed"}


def _num_calls(output: list[dict[str, Any]]) -> int:
    return sum(item["type"] == "function_call" for item in output)


def verdict_components(verdict: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """A Gym verify result's components: its `reward_components`, and every other finite number it adds to
    the `row` it verified (Gym's multi-reward servers give each component as a field of its own too, and
    counters such as tool_use's `num_tool_calls` come only that way; NeMo-RL averages the same fields
    into its per-agent metrics). Flags (`mask_sample`) and the row's own numbers are not components."""
    added = {
        key: float(value)
        for key, value in verdict.items()
        if key not in row and key != "reward" and _is_finite_number(value)
    }
    listed = verdict.get("reward_components") or {}
    return {**added, **{key: float(value) for key, value in listed.items() if _is_finite_number(value)}}


def _is_finite_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value == value
        and abs(value) != float("inf")
    )
