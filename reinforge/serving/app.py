"""The endpoint's routes (FastAPI): OpenAI's chat completions with NeMo-RL's token fields.

    POST /v1/chat/completions            messages, tools, temperature, top_p, max_tokens, n, stop, seed, logprobs
    POST /episodes/{id}/v1/chat/completions   the same, recorded under episode `id` (a Python agent's base_url)
    POST /tokenize, /episodes/{id}/tokenize   vLLM's: the prompt tokens chat completions would use (splice included)
    GET  /v1/models                      the one model
    GET  /metrics                        requests and engine batches since the last call
    GET  /health                         {"status": "ok"} (the only route open without the token)

Every assistant message carries `prompt_token_ids` (the engine's exact prompt, after the splice of
serving/prompt.py), `generation_token_ids` (the sampled tokens, stop token included) and
`generation_log_probs` (each one's logprob under the distribution sampled from), as NeMo Gym's
`vllm_model` reads them with `return_token_id_information: true`. Tool calls in the Hermes/Qwen
`<tool_call>` convention come back as OpenAI `tool_calls` (`finish_reason: "tool_calls"`).

Errors are OpenAI's shape, `{"error": {"message", "type", "param"}}`: a malformed request is 400 with
the field at fault, a prompt over the context length is 400 saying so ("context length": Gym turns
that into a `length` finish), a call outside a run's rollout 503, a call of an episode that is over
409. The guards of the env servers apply (bearer token, body size, JSON content type).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from reinforge.errors import DataError
from reinforge.generation.base import SamplingParams
from reinforge.http_guard import Guard
from reinforge.serving.prompt import parse_generation, prompt_ids
from reinforge.serving.protocol import ChatCompletionRequest, TokenizeRequest, completion_choice, error_body
from reinforge.serving.recorder import RecordedCall

if TYPE_CHECKING:  # the server builds this app; the app only reads the server's state
    from reinforge.serving.server import PolicyServer, RolloutSession

SAMPLING_TOLERANCE = 1e-6


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def build_app(server: PolicyServer) -> FastAPI:
    app = FastAPI(title="reinforge policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = server.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        server.counts["rejected"] += 1
        return JSONResponse(error_body(exc.message, exc.param, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        server.counts["rejected"] += 1
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        if first["type"] == "json_invalid":
            return JSONResponse(
                error_body(f"bad request: the body is not valid JSON ({first.get('ctx', {}).get('error', '')})"), 400
            )
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        return JSONResponse(error_body(f"bad request: {where}: {first['msg']}{more}", where), status_code=400)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "reinforge",
                    "max_model_len": server.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    def metrics() -> dict:
        return {"metrics": server.metrics()}

    async def chat(body: ChatCompletionRequest, episode_id: str | None) -> dict:
        server.counts["requests"] += 1
        if body.tool_choice not in (None, "auto", "none"):
            raise ApiError(
                400,
                f"tool_choice={body.tool_choice!r} is not supported: the policy decides whether to call a tool "
                "('auto'), or is shown no tools ('none')",
                "tool_choice",
            )
        tools = None if body.tool_choice == "none" else body.tools
        prompt = _prompt(tokenizer, body.messages, tools, body.required_prefix_token_ids)
        with server.lock:  # admitted and queued at once, so that a closing session never misses a call
            params, alone, session = _admit(server, body, len(prompt), episode_id)
            future = server.batcher.submit(prompt, params, alone)
        try:
            completions = await asyncio.wrap_future(future)
        except Exception as exc:
            raise ApiError(
                500, f"generation failed: {' '.join(str(exc).split()) or type(exc).__name__}", kind="server_error"
            )
        choices, num_generated = [], 0
        for index, completion in enumerate(completions):
            truncated = completion.finish_reason == "length"
            if session is not None:
                session.recorder.record(
                    RecordedCall(prompt, list(completion.token_ids), list(completion.logprobs), truncated), episode_id
                )
            parsed = parse_generation(tokenizer, completion.token_ids, truncated, params.stop_strings)
            strings = (
                _token_strings(tokenizer, completion.token_ids, bool(body.return_tokens_as_token_ids))
                if body.logprobs
                else None
            )
            choices.append(
                completion_choice(
                    index,
                    parsed.content,
                    parsed.tool_calls,
                    parsed.finish_reason,
                    prompt,
                    list(completion.token_ids),
                    list(completion.logprobs),
                    strings,
                )
            )
            num_generated += len(completion.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": num_generated,
                "total_tokens": len(prompt) + num_generated,
            },
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> dict:
        return await chat(body, None)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat_completions(episode_id: str, body: ChatCompletionRequest) -> dict:
        return await chat(body, episode_id)

    def tokenize(body: TokenizeRequest) -> dict:
        if (body.messages is None) == (body.prompt is None):
            raise ApiError(400, "bad request: give either messages (chat) or prompt (text)", "messages")
        if body.messages is not None:
            tokens = _prompt(
                tokenizer, body.messages, body.tools, body.required_prefix_token_ids, body.add_generation_prompt
            )
        else:
            tokens = list(tokenizer(body.prompt, add_special_tokens=False)["input_ids"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}

    @app.post("/tokenize")
    def tokenize_route(body: TokenizeRequest) -> dict:
        return tokenize(body)

    @app.post("/episodes/{episode_id}/tokenize")
    def episode_tokenize(episode_id: str, body: TokenizeRequest) -> dict:
        return tokenize(body)

    app.add_middleware(
        Guard, token=server.token, max_request_bytes=server.config.max_request_bytes, open_paths=("/health",)
    )
    return app


def _prompt(tokenizer, messages, tools, required_prefix, add_generation_prompt: bool = True) -> list[int]:
    try:
        return prompt_ids(tokenizer, messages, tools, required_prefix, add_generation_prompt)
    except DataError as exc:
        raise ApiError(400, f"bad request: {exc}", "messages") from None


def _admit(
    server: PolicyServer, body: ChatCompletionRequest, prompt_length: int, episode_id: str | None
) -> tuple[SamplingParams, bool, RolloutSession | None]:
    """The sampling settings to generate `body` with, whether it is generated alone (its own seed), and the
    rollout session it belongs to (None standalone); raises ApiError for a request the endpoint must refuse."""
    session = server.session
    if server.managed:
        if session is None:
            raise ApiError(
                503,
                "the policy is being trained: this endpoint serves agents only during the run's rollouts",
                kind="unavailable",
            )
        if episode_id is not None and episode_id not in session.open_episodes:
            raise ApiError(
                409,
                f"episode {episode_id} is over (it ended or timed out); its calls are no longer recorded",
                kind="conflict",
            )
        run = session.sampling
        for name, asked, allowed in (
            ("temperature", body.temperature, run.temperature),
            ("top_p", body.top_p, run.top_p),
        ):
            if asked is not None and abs(asked - allowed) > SAMPLING_TOLERANCE:
                raise ApiError(
                    400,
                    f"{name}={asked} differs from the run's {name}={allowed}: during training the policy samples "
                    "as the trainer scores it; send the run's value or none",
                    name,
                )
        if body.top_k not in (None, -1, 0, run.top_k):
            raise ApiError(400, f"top_k={body.top_k} differs from the run's top_k={run.top_k}", "top_k")
        if body.n != 1:
            raise ApiError(
                400, f"n={body.n}: during training each call samples one completion (an episode is one trajectory)", "n"
            )
        max_new_tokens = min(body.requested_max_tokens() or run.max_new_tokens, run.max_new_tokens)
        params, alone = (
            replace(run, max_new_tokens=max_new_tokens, num_samples=1, stop_strings=body.stop_strings()),
            False,
        )
    else:
        max_new_tokens = body.requested_max_tokens() or server.default_max_tokens
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else body.top_k,
            stop_strings=body.stop_strings(),
            num_samples=body.n,
            seed=body.seed or 0,
        )
        alone = body.seed is not None
    room = server.max_model_len - prompt_length
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {server.max_model_len} tokens, and the prompt has {prompt_length} "
            "tokens; shorten the conversation",
            "messages",
        )
    return replace(params, max_new_tokens=min(params.max_new_tokens, room)), alone, session


def _token_strings(tokenizer, token_ids: list[int], as_ids: bool) -> list[str]:
    if as_ids:
        return [f"token_id:{token}" for token in token_ids]
    return [tokenizer.decode([token]) for token in token_ids]
