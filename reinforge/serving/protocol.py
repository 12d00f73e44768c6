"""The request and response shapes of the endpoint: OpenAI's chat completions, with NeMo-RL's token fields.

Requests are validated here (pydantic); unknown extra fields are accepted, as OpenAI-compatible
servers do (clients send vendor extras, e.g. Gym's `return_tokens_as_token_ids`). Messages keep
their extras too: an assistant message sent back by the `openai` client carries `refusal`,
`annotations` and, from this endpoint, the three token fields, which the prefix splice uses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    prompt_token_ids: list[int] | None = None
    """The exact prompt this endpoint generated the message from (the on-policy prefix splice uses it)."""
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


class ChatCompletionRequest(_Open):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    """A 64-bit integer, as the engines take it."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    """Only the sampled token's logprob is known (0 or null)."""
    return_tokens_as_token_ids: bool | None = None
    required_prefix_token_ids: list[int] | None = None
    """Gym's `supply_prefix_token_ids`: the tokens the prompt must start with (the splice's required prefix)."""
    stream: Literal[False] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


class TokenizeRequest(_Open):
    """vLLM's `/tokenize`: chat messages (rendered as chat completions renders them, splice included), or a
    prompt text."""

    model: str | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    required_prefix_token_ids: list[int] | None = None


def completion_choice(
    index: int,
    content: str | None,
    tool_calls: list[dict[str, Any]] | None,
    finish_reason: str,
    prompt_ids: list[int],
    generation_ids: list[int],
    logprobs: list[float],
    token_strings: list[str] | None,
) -> dict:
    """One `choices[i]`: the OpenAI message plus `prompt_token_ids`, `generation_token_ids`, `generation_log_probs`;
    `logprobs.content` when `token_strings` (the request asked for logprobs) is given."""
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": tool_calls or None,
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": generation_ids,
        "generation_log_probs": logprobs,
    }
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if token_strings is not None:
        choice["logprobs"] = {
            "content": [
                {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                for token, logprob in zip(token_strings, logprobs)
            ]
        }
    return choice


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape (the `openai` client shows `message`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
