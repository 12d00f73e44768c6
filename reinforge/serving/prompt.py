"""From a chat request to the engine's prompt tokens, and from sampled tokens back to an OpenAI message.

The on-policy prefix splice (the rule of NeMo-RL's `replace_prefix_tokens`). An agent sends its history
back as messages, and re-rendering an earlier assistant turn can give other tokens than the policy
sampled (a tool call's JSON re-serialised with other spacing, a dropped `<think>` block). The trainer
would then score tokens the policy never produced. So when the history holds an assistant message that
carries this endpoint's `prompt_token_ids` and `generation_token_ids` (or the request gives
`required_prefix_token_ids`), the prompt is exactly those tokens, then one EOS, then the newly
rendered tail:

1. required prefix: `required_prefix_token_ids`, else the last such message's prompt + generation ids;
2. render the whole conversation with the generation prompt (the *template*), and the messages up to
   and including that assistant message without it (the *template prefix*);
3. with N the number of EOS tokens in the template prefix, the tail is the template after its N-th
   EOS (counting EOS tokens, not positions, survives templates that shorten old turns);
4. prompt = required prefix without a trailing EOS, one EOS, the tail.

Turn k+1's prompt then extends turn k's prompt + generation token for token (a generation cut by
length or a stop string has no EOS of its own; one is added, as the template would close the turn).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from reinforge.data.images import (
    ImageInputs,
    collapse_images,
    expand_images,
    image_messages,
    load_image,
    process_images,
    record_image_refs,
)
from reinforge.data.templates import render_ids
from reinforge.data.tool_calls import ToolCall, parse_tool_calls, text_outside_calls
from reinforge.errors import DataError
from reinforge.serving.protocol import ChatMessage


def splice(required_prefix: list[int], template: list[int], template_prefix: list[int], eos_id: int) -> list[int]:
    """The prompt that keeps `required_prefix` (the tokens already sampled) and takes only the new turn
    from `template` (see the module doc)."""
    num_eos = template_prefix.count(eos_id)
    positions = [i for i, token in enumerate(template) if token == eos_id]
    if num_eos == 0 or len(positions) < num_eos:
        raise DataError(
            f"cannot splice the history's token ids into the prompt: the rendered conversation has {len(positions)} "
            f"end-of-turn tokens where its earlier turns have {num_eos}; the messages after the last assistant "
            "message with token ids must not rewrite it"
        )
    kept = required_prefix[:-1] if required_prefix and required_prefix[-1] == eos_id else required_prefix
    return kept + [eos_id] + template[positions[num_eos - 1] + 1 :]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tools: list[dict] | None,
    required_prefix: list[int] | None = None,
    add_generation_prompt: bool = True,
    render: Callable[[list[dict[str, Any]], bool], list[int]] | None = None,
) -> list[int]:
    """The engine's prompt for `messages`: the rendered conversation, spliced onto the tokens of the last
    assistant message that carries them (or onto `required_prefix`). `render(messages, add_generation_prompt)`
    tokenizes a conversation (default: the tokenizer's chat template; `image_prompt`'s: the processor's)."""
    render = render or (lambda dicts, generation: render_ids(tokenizer, dicts, tools, generation))
    dicts = message_dicts(messages)
    template = render(dicts, add_generation_prompt)
    carrier = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].role == "assistant" and messages[i].prompt_token_ids is not None
        ),
        None,
    )
    if required_prefix is None and carrier is not None:
        required_prefix = list(messages[carrier].prompt_token_ids) + list(messages[carrier].generation_token_ids or [])
    if required_prefix is None:
        return template
    if carrier is None:  # an explicit prefix: it ends where the last assistant message does
        carrier = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), None)
        if carrier is None:
            raise DataError("required_prefix_token_ids needs an assistant message in the history to splice after")
    template_prefix = render(dicts[: carrier + 1], False)
    return splice(required_prefix, template, template_prefix, tokenizer.eos_token_id)


def image_prompt(
    processor: Any,
    messages: list[ChatMessage],
    tools: list[dict] | None,
    required_prefix: list[int] | None = None,
    add_generation_prompt: bool = True,
) -> tuple[list[int], ImageInputs | None]:
    """`prompt_ids` of a conversation whose messages may hold images (`image_url` parts with data URLs, rendered
    by a vision-language model's `processor`, each expanded into its image tokens), and its images (None when it
    has none). The splice works as for text: earlier turns' token ids already hold their images' tokens."""
    refs = record_image_refs({}, message_dicts(messages))
    if not refs:
        return prompt_ids(processor.tokenizer, messages, tools, required_prefix, add_generation_prompt), None
    for ref in refs:
        if not ref.startswith("data:"):
            raise DataError(
                f"image {ref[:60]!r}: the endpoint takes images as data URLs (data:image/png;base64,...); it reads "
                "no files and fetches no web URLs"
            )
    inputs = process_images(processor, [load_image(ref, Path(".")) for ref in refs])  # the request's one pass

    def render(dicts: list[dict[str, Any]], generation: bool) -> list[int]:
        shown = inputs.expansions[: len(record_image_refs({}, dicts))]  # the images of these messages, in order
        text = processor.apply_chat_template(
            image_messages(dicts, 0),
            tokenize=False,
            add_generation_prompt=generation,
            **({"tools": tools} if tools else {}),
        )
        return expand_images(processor, list(processor.tokenizer(text, add_special_tokens=False)["input_ids"]), shown)

    ids = prompt_ids(processor.tokenizer, messages, tools, required_prefix, add_generation_prompt, render)
    inputs.engine_prompt_ids = collapse_images(processor, ids, inputs)
    return ids, inputs


@dataclass
class ParsedGeneration:
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # "stop", "length" or "tool_calls"


def parse_generation(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], truncated: bool, stop_strings: tuple[str, ...]
) -> ParsedGeneration:
    """The sampled tokens as an OpenAI assistant message: well-formed `<tool_call>` blocks become `tool_calls`
    (a malformed one stays in the content, as the model wrote it), a request's stop string is not part of the
    content."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    for stop in stop_strings:
        if text.endswith(stop):
            text = text[: -len(stop)]
            break
    calls = [call for call in parse_tool_calls(text) if isinstance(call, ToolCall)]
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:16]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
        }
        for call in calls
    ]
    if tool_calls:
        content = text_outside_calls(text) or None
    else:
        content = text
    finish_reason = "length" if truncated else ("tool_calls" if tool_calls else "stop")
    return ParsedGeneration(content=content, tool_calls=tool_calls, finish_reason=finish_reason)
