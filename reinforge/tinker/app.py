"""The Tinker service's HTTP adapter: FastAPI routes under /api/v1/ as the `tinker` SDK calls them (wire.py's notes
say what it expects), over `TinkerService`. Every error answer is `{"detail": "<one line>"}` with the status the
SDK turns into its own exception; no traceback leaves the server. An unexpected exception in a route is answered 400
(`tinker.BadRequestError`), not 5xx: the SDK retries a 5xx for five minutes, and retrying a bug gains nothing."""

from __future__ import annotations

import hmac
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from tinker import types

from reinforge.network import error_response, one_line
from reinforge.tinker.errors import TinkerRequestError, Unauthorized
from reinforge.tinker.service import TinkerService
from reinforge.tinker.wire import PROTO_TYPE, decode_forward_backward

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/api/v1/healthz", "/health")


def build_app(service: TinkerService) -> FastAPI:
    app = FastAPI(title="reinforge Tinker service", docs_url=None, redoc_url=None, openapi_url=None)
    _add_guard(app, service)

    @app.exception_handler(TinkerRequestError)
    async def _refused(request: Request, exc: TinkerRequestError) -> JSONResponse:
        return error_response(exc.status, one_line(exc))

    _add_service_routes(app, service)
    _add_training_routes(app, service)
    _add_sampling_routes(app, service)
    return app


def _add_guard(app: FastAPI, service: TinkerService) -> None:
    @app.middleware("http")
    async def guard(request: Request, call_next: Callable):
        if request.url.path not in OPEN_PATHS:
            try:
                _check_key(request.headers.get("x-api-key", ""), service.token)
            except Unauthorized as exc:
                return error_response(401, str(exc))
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > service.config.tinker.max_request_bytes:
            limit = service.config.tinker.max_request_bytes
            return error_response(413, f"request body over the server's limit of {limit} bytes; send smaller batches")
        try:
            return await call_next(request)
        except Exception as exc:  # a bug of ours: logged here, one line for the client, which must not retry it
            logger.exception("tinker route %s failed", request.url.path)
            return error_response(400, f"server error in {request.url.path}: {one_line(exc)} (see the server's log)")


def _check_key(key: str, token: str | None) -> None:
    if token is not None:
        if not hmac.compare_digest(key.encode(), token.encode()):
            raise Unauthorized("wrong API key: send the server's token as TINKER_API_KEY (X-API-Key)")
    elif not key.startswith("tml-"):
        raise Unauthorized("missing API key: set TINKER_API_KEY to any key starting with tml- (this server has none)")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as the SDK's request type; a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(await request.json())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise TinkerRequestError(f"bad {model.__name__}: {where}: {first['msg']}") from None
    except ValueError:
        raise TinkerRequestError(f"bad {model.__name__}: the body is not JSON") from None


def _add_service_routes(app: FastAPI, service: TinkerService) -> None:
    @app.get("/api/v1/healthz")
    @app.get("/health")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "custom_loss_server_side": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
            "fwdbwd_max_chunk_len": service.config.tinker.max_datums_per_request,
            "fwdbwd_max_chunk_bytes_count": service.config.tinker.max_request_bytes // 2,
        }

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}  # the SDK's own diagnostics: nothing here reads them

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return service.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        return service.create_session(await _parse(request, types.CreateSessionRequest))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        service.sessions.heartbeat((await _parse(request, types.SessionHeartbeatRequest)).session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> None:
        service.sessions.get(session_id)
        service.sessions.close(session_id, "finished by the client")

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _parse(request, types.FutureRetrieveRequest)
        service.sessions.touch(service.futures.session_of(body.request_id) or "")
        record = await service.futures.wait(body.request_id, service.config.tinker.retrieve_wait_s)
        if record is None:
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if record.error is not None:
            return JSONResponse({"error": record.error[0], "category": record.error[1]})
        if record.payload.is_proto:
            return Response(record.payload.body, media_type=PROTO_TYPE)
        return JSONResponse(record.payload.body)

    @app.post("/api/v1/cancel_future")
    async def cancel_future() -> None:
        return None  # a sample runs to its end; its result is dropped with the others after result_ttl_s


def _add_training_routes(app: FastAPI, service: TinkerService) -> None:
    routes = {
        "create_model": (types.CreateModelRequest, service.create_model),
        "optim_step": (types.OptimStepRequest, service.optim_step),
        "save_weights": (types.SaveWeightsRequest, service.save_weights),
        "save_weights_for_sampler": (types.SaveWeightsForSamplerRequest, service.save_weights_for_sampler),
        "load_weights": (types.LoadWeightsRequest, service.load_weights),
    }
    for name, (model, handler) in routes.items():
        _json_route(app, f"/api/v1/{name}", model, handler)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        return service.get_info((await _parse(request, types.GetInfoRequest)).model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type != PROTO_TYPE:
            raise TinkerRequestError(f"forward_backward takes a protobuf body ({PROTO_TYPE}), got {content_type!r}")
        call = decode_forward_backward(await request.body(), request.headers.get("content-encoding", ""))
        return service.forward_backward(call)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict:
        body = await request.json()
        return service.weights_info(str(body.get("tinker_path", "")) if isinstance(body, dict) else "")

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> dict:
        return service.list_checkpoints(model_id)


def _add_sampling_routes(app: FastAPI, service: TinkerService) -> None:
    _json_route(
        app, "/api/v1/create_sampling_session", types.CreateSamplingSessionRequest, service.create_sampling_session
    )
    _json_route(app, "/api/v1/asample", types.SampleRequest, service.asample)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> dict:
        return service.get_sampler(sampler_id)


def _json_route(app: FastAPI, path: str, model: type[BaseModel], handler: Callable[[Any], dict]) -> None:
    async def route(request: Request) -> dict:
        return handler(await _parse(request, model))

    app.add_api_route(path, route, methods=["POST"], name=path.rsplit("/", 1)[-1])
