"""Chat records to token ids and a loss mask that is 1 exactly on the assistant's tokens.

The method is the prefix diff, which needs nothing from a template but that it renders a conversation
turn by turn: for each assistant message i,

    prompt_i = render(messages[:i], add_generation_prompt=True)     ends where the reply starts
    full_i   = render(messages[:i + 1])                              ends after the reply's end-of-turn

so `full_i[len(prompt_i):]` is the reply as the template frames it (ChatML: `answer<|im_end|>\\n`).
Trailing whitespace of that span is the template's separator between turns, which the model never
generates (generation stops at the end-of-turn token), so it is not trained on: the mask covers
`answer<|im_end|>`. Everything else (system, user and tool messages, role headers) is 0.

Each text segment is tokenized on its own, as at generation time, where the prompt is tokenized apart
from the reply. A template that rewrites earlier turns (e.g. one that drops past reasoning) is not
prefix-consistent and is rejected with a `DataError`, never silently mis-masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from reinforge.data.images import (
    ImageInputs,
    expand_images,
    image_messages,
    load_image,
    process_images,
    record_image_refs,
)
from reinforge.errors import DataError

TRAINED_ROLE = "assistant"


@dataclass
class ChatExample:
    """One tokenized conversation."""

    token_ids: list[int]  # [L] the whole conversation as the chat template renders it
    loss_mask: list[int]  # [L] 1 on assistant tokens (content and end-of-turn), else 0; loss_mask[0] == 0
    images: ImageInputs | None = None  # a vision-language chat's images; token_ids hold their image tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)


def chat_segments(messages: list[dict[str, Any]], tokenizer: Any) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, trained) pieces, by the prefix diff."""
    segments: list[tuple[str, bool]] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] != TRAINED_ROLE:
            continue
        if i == 0:
            raise DataError("a conversation starts with an assistant message; there is nothing for it to answer")
        prompt = _render(messages[:i], tokenizer, add_generation_prompt=True)
        full = _render(messages[: i + 1], tokenizer, add_generation_prompt=False)
        if not (prompt.startswith(rendered) and full.startswith(prompt)):
            raise DataError(
                f"the chat template does not render message {i} as an extension of the messages before it "
                "(it rewrites earlier turns), so the assistant tokens cannot be located; "
                "use a prefix-consistent template"
            )
        reply = full[len(prompt) :]
        trained = reply.rstrip()
        segments += [(prompt[len(rendered) :], False), (trained, True), (reply[len(trained) :], False)]
        rendered = full
    if not any(trained for _, trained in segments):
        raise DataError(f"a conversation has no {TRAINED_ROLE} message; there is nothing to train on")
    segments.append((_render(messages, tokenizer, add_generation_prompt=False)[len(rendered) :], False))
    return [(text, trained) for text, trained in segments if text]


def render_chat(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    messages_key: str = "messages",
    system_prompt: str | None = None,
    processor: Any = None,
    base_dir: Path = Path("."),
) -> ChatExample:
    """Token ids and loss mask of one chat record; `system_prompt` is put first unless the chat has a system
    message. A chat with images needs a vision-language model's `processor`; image paths are relative to
    `base_dir` (the data file's directory)."""
    messages = [{"role": str(m["role"]), "content": m["content"]} for m in record[messages_key]]
    refs = record_image_refs(record, messages)
    if refs and processor is None:
        raise DataError("the chat has images, but the model is text-only; use a vision-language model")
    if system_prompt is not None and messages and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not refs:
        messages = [{**m, "content": _text(m["content"])} for m in messages]
        return _tokenize(chat_segments(messages, tokenizer), tokenizer)
    images = process_images(processor, [load_image(ref, base_dir) for ref in refs])  # the one processor pass
    messages = image_messages(messages, len(images) if {"images", "image"} & record.keys() else 0)
    example = _tokenize(chat_segments(messages, processor), tokenizer, processor, images)
    example.images = images
    return example


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text of its text parts."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _tokenize(
    segments: list[tuple[str, bool]], tokenizer: Any, processor: Any = None, images: ImageInputs | None = None
) -> ChatExample:
    """The segments' token ids, each tokenized apart; with a processor, a segment's image placeholders expanded
    into the image tokens of the next images in order."""
    token_ids: list[int] = []
    loss_mask: list[int] = []
    remaining = list(images.expansions) if images is not None else []
    for text, trained in segments:
        count = text.count(processor.image_token) if processor is not None else 0
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if count:
            own, remaining = remaining[:count], remaining[count:]
            ids = expand_images(processor, ids, own)
        if count and trained:
            raise DataError("an assistant message holds an image; images go in user (or tool) messages")
        token_ids += ids
        loss_mask += [int(trained)] * len(ids)
    if remaining:
        shown = len(images or ()) - len(remaining)
        raise DataError(f"the chat template rendered {shown} of the chat's {len(images or ())} images")
    loss_mask[0] = 0  # column 0 has no preceding token to predict it from (data/batch.py's convention)
    return ChatExample(token_ids=token_ids, loss_mask=loss_mask)


def fit_length(example: ChatExample, max_seq_len: int, policy: Literal["right", "drop"]) -> ChatExample | None:
    """Apply the truncation policy to an example longer than `max_seq_len` tokens.

    `right` keeps the first max_seq_len tokens (the prompt and the start of the reply are what the model
    learns to continue); `drop` drops the example. An example left with no trained token is dropped, and so is
    an image chat whatever the policy.
    """
    if len(example) <= max_seq_len:
        return example
    if policy == "drop":
        return None
    if example.images is not None:  # never cut: a cut could part an image's tokens from its features
        return None
    cut = ChatExample(token_ids=example.token_ids[:max_seq_len], loss_mask=example.loss_mask[:max_seq_len])
    return cut if cut.num_trained_tokens else None


def _render(messages: list[dict[str, Any]], tokenizer: Any, add_generation_prompt: bool) -> str:
    """The chat rendered by the tokenizer's (or a processor's) chat template."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
