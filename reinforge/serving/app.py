"""The endpoint's routes (FastAPI): an HTTP adapter over `PolicyServer`, OpenAI's chat completions with
NeMo-RL's token fields.

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

The server decides what is admitted (`PolicyServer.admit`); this module maps its errors to statuses, in
OpenAI's shape `{"error": {"message", "type", "param"}}`: a malformed request is 400 with the field at
fault, a prompt over the context length is 400 saying so ("context length": Gym turns that into a
`length` finish), a call outside a run's rollout 503, a call of an episode that is over 409, a failed
generation 500, a request beyond the bounded queue (`max_queued_requests`) 429 with Retry-After. The guards
of the env servers apply (bearer token, body size, JSON content type).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from reinforge.network import Guard, one_line
from reinforge.serving.errors import (
    EndpointError,
    EpisodeOver,
    GenerationFailed,
    GenerationTimedOut,
    InvalidRequest,
    NotInRollout,
    QueueFull,
)
from reinforge.serving.prompt import parse_generation
from reinforge.serving.protocol import ChatCompletionRequest, TokenizeRequest, completion_choice, error_body
from reinforge.serving.server import PolicyServer

STATUSES: dict[type[EndpointError], tuple[int, str]] = {  # error -> (HTTP status, OpenAI error type)
    InvalidRequest: (400, "invalid_request_error"),
    EpisodeOver: (409, "conflict"),
    NotInRollout: (503, "unavailable"),
    GenerationFailed: (500, "server_error"),
    GenerationTimedOut: (504, "timeout"),
    QueueFull: (429, "rate_limit_exceeded"),
}


routes = APIRouter()  # the routes, each beside its handler below; build_app mounts them over one server


def build_app(server: PolicyServer) -> FastAPI:
    """The routes over `server`; serve them with `server.start(build_app(server))`."""
    app = FastAPI(title="reinforge policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server  # the routes below find it there
    app.add_exception_handler(EndpointError, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.include_router(routes)
    app.add_middleware(
        Guard, token=server.token, max_request_bytes=server.config.max_request_bytes, open_paths=("/health",)
    )
    return app


def _server(request: Request) -> PolicyServer:
    return request.app.state.server


async def _refused(request: Request, exc: EndpointError) -> JSONResponse:
    _server(request).count_rejected()
    status, kind = STATUSES[type(exc)]
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFull) else None
    return JSONResponse(error_body(exc.message, exc.param, kind), status_code=status, headers=headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    _server(request).count_rejected()
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
    if first["type"] == "json_invalid":
        return JSONResponse(
            error_body(f"bad request: the body is not valid JSON ({first.get('ctx', {}).get('error', '')})"), 400
        )
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return JSONResponse(error_body(f"bad request: {where}: {first['msg']}{more}", where), status_code=400)


@routes.get("/health")
def health() -> dict:
    return {"status": "ok"}


@routes.get("/v1/models")
def models(request: Request) -> dict:
    server = _server(request)
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


@routes.get("/metrics")
def metrics(request: Request) -> dict:
    return {"metrics": _server(request).metrics()}


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict:
    return await _chat(_server(request), body, None)


@routes.post("/episodes/{episode_id}/v1/chat/completions")
async def episode_chat_completions(episode_id: str, body: ChatCompletionRequest, request: Request) -> dict:
    return await _chat(_server(request), body, episode_id)


@routes.post("/tokenize")
def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return _tokenize(_server(request), body)


@routes.post("/episodes/{episode_id}/tokenize")
def episode_tokenize(episode_id: str, body: TokenizeRequest, request: Request) -> dict:
    return _tokenize(_server(request), body)


async def _chat(server: PolicyServer, body: ChatCompletionRequest, episode_id: str | None) -> dict:
    admission = server.admit(body, episode_id)
    try:
        timeout_s = server.config.request_timeout_s
        completions = await asyncio.wait_for(asyncio.wrap_future(admission.completions), timeout_s)
    except TimeoutError:  # the request is cancelled: the batcher drops it if it has not started it
        raise GenerationTimedOut(
            f"no completion within {timeout_s:g} s (request_timeout_s): the engine is overloaded or stuck"
        ) from None
    except Exception as exc:
        raise GenerationFailed(f"generation failed: {one_line(exc)}") from None
    server.record(admission, completions)
    tokenizer, prompt, choices = server.tokenizer, admission.prompt_ids, []
    for index, completion in enumerate(completions):
        truncated = completion.finish_reason == "length"
        parsed = parse_generation(tokenizer, completion.token_ids, truncated, admission.params.stop_strings)
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
    num_generated = sum(len(completion.token_ids) for completion in completions)
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


def _tokenize(server: PolicyServer, body: TokenizeRequest) -> dict:
    tokens = server.tokenize(body)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}


def _token_strings(tokenizer, token_ids: list[int], as_ids: bool) -> list[str]:
    if as_ids:
        return [f"token_id:{token}" for token in token_ids]
    return [tokenizer.decode([token]) for token in token_ids]
