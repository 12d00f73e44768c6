"""Rendering OpenAI-shaped chat messages and tools with a model's chat template.

One renderer for the prompts reinforge samples from (data/prompts.py), NeMo Gym rows, and the
OpenAI-compatible endpoint (serving/), so that the three agree token for token.

Messages come in OpenAI's chat shapes: `content` a string, None, or a list of `{"type": "text", "text"}`
parts; assistant messages may carry `tool_calls` (`{"id", "type": "function", "function": {"name",
"arguments": JSON string}}`); `tool` messages answer them. They are normalised for the template:
content becomes a string, `arguments` a mapping (Qwen's templates take either), and the `developer`
role becomes `system` (OpenAI's newer name for it, which most open chat templates do not know).

A template that knows nothing of tools (no `tools` / `tool_calls` in its source, like the demo
model's) still gets them, in the Hermes convention the policy answers in: calls as `<tool_call>`
text in the assistant's content, and the tool list in a system message.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from reinforge.data.tool_calls import format_tool_call
from reinforge.errors import DataError

TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: Any) -> str:
    """A message's content as one string: a string as it is, None as "", text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DataError(f"message content part of type {kind!r} is not supported: only text parts are")
        return "".join(texts)
    raise DataError(f"message content must be a string, null or a list of text parts, got {type(content).__name__}")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools in chat-completions form (`{"type": "function", "function": {...}}`), from that form or from the
    Responses form (`{"type": "function", "name", "parameters", ...}`); OpenAI's `strict` is dropped."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise DataError(f"only function tools are supported, got {tool!r:.80}")
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"a function tool needs a name: {tool!r:.80}")
        spec = {key: function[key] for key in ("name", "description", "parameters") if key in function}
        out.append({"type": "function", "function": spec})
    return out


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template-ready copies of OpenAI-shaped messages (see the module doc); token fields are dropped."""
    out = []
    for message in messages:
        role = message.get("role")
        if not isinstance(role, str):
            raise DataError(f"a message needs a string role: {message!r:.80}")
        normalized: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": content_text(message.get("content")),
        }
        if message.get("tool_calls"):
            normalized["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                normalized[key] = message[key]
        out.append(normalized)
    return out


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"a tool call needs function.name: {call!r:.80}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the model wrote it; the template shows the string
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template or ""
    return "tool_calls" in template and "tools" in template


def render_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation as the chat template renders it (normalised first; see the module doc)."""
    if tokenizer.chat_template is None:
        raise DataError(
            "the model's tokenizer has no chat template; chat messages cannot be rendered "
            "(set data.use_chat_template=false for plain prompts)"
        )
    messages, tools = normalize_messages(messages), chat_tools(tools)
    if not supports_tools(tokenizer):
        messages, tools = _hermes_fallback(messages, tools), None
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """`render_messages`, tokenized as generation sees it (no special tokens added beyond the template's)."""
    text = render_messages(tokenizer, messages, tools, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _hermes_fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """For a template without tool support: calls as `<tool_call>` text, tools listed in a system message."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "".join(
                format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
            )
            message = {"role": message["role"], "content": message["content"] + calls}
        out.append({"role": message["role"], "content": message["content"]})
    if tools:
        listing = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
        text = (
            'You may call these tools, one call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:\n'
            + listing
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
