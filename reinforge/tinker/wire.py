"""What travels between the `tinker` SDK (0.38) and this server, and its conversions.

What the SDK expects (its source is the specification; tinker/lib/internal_client_holder.py,
lib/api_future_impl.py, resources/*.py, proto/):
- Startup of a `ServiceClient`: POST /api/v1/client/config (`ClientConfigResponse`: feature flags; ours turn off
  JWT auth, pyqwest, zstd bodies, server-side custom losses and the sampling futures poller), then POST
  /api/v1/client/dynamic_config (a 404 would do, we answer the defaults), POST /api/v1/create_session
  (`{"session_id"}`), then every 10 s POST /api/v1/session_heartbeat (a 410 stops it), and POST /api/v1/telemetry
  batches (we accept and drop them). The key goes in `X-API-Key` (the SDK refuses keys without `tml-`).
- Futures: create_model, forward_backward (forward = `forward_only`), optim_step, save_weights(_for_sampler),
  load_weights and asample answer an `UntypedAPIFuture` `{"request_id", "model_id"?}` (asample's also carries
  `sample_sequence_ids`, one per sample). The SDK then POSTs /api/v1/retrieve_future `{"request_id"}` until it
  gets an answer: `{"type": "try_again", ...}` means pending and it polls again AT ONCE (so we hold the poll up to
  `tinker.retrieve_wait_s`); `{"error", "category": "user"|"server"}` raises `tinker.RequestFailedError` with the
  message; anything else is the result. ForwardBackwardOutput and SampleResponse must come as protobuf
  (`Content-Type: application/x-protobuf`, the SDK sends `Accept` for them and refuses JSON); the other results
  are JSON. HTTP statuses on a poll: 408 and 5xx are retried at once, 429 with back-off, 410 re-raises as
  retryable, a 400 is retried 3 times, anything else raises ValueError.
- HTTP statuses on a submission (`execute_with_retries`): 408/409/429/5xx are retried for up to 5 minutes, any
  other raises the SDK's class for it: 400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 422
  UnprocessableEntityError; its message is `Error code: 400 - {'detail': '...'}`. A 400 with an empty body reads as
  a proxy's and is retried: ours always carry a body.
- forward_backward's body is protobuf (`tinker_public.ForwardBackwardRequest`): model_id, seq_id, loss_fn,
  loss_fn_config(_v2), forward_only, data (each: model_input chunks, encoded_text tokens as int32 bytes;
  loss_fn_inputs as Tensors: dense bytes or sparse CSR, dtype float32|int64, shape).
- A training client numbers its requests: seq_id = 1, 2, ... (after create_model; a create-via-load_weights is
  the model's request 0); it may send them out of order and expects them run in order (futures.py).
- model ids are `{session_id}:train:{model_seq_id}`, checkpoint paths `tinker://{model_id}/weights/{name}` and
  `tinker://{model_id}/sampler_weights/{name}`; get_info's `model_data.tokenizer_id` is what the SDK's
  `get_tokenizer()` loads with AutoTokenizer (we give the model directory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reinforge.tinker.errors import TinkerRequestError

PROTO_TYPE = "application/x-protobuf"


@dataclass
class WireDatum:
    """One datum as the SDK sent it: the model input's tokens and the loss inputs by name."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    sampled: np.ndarray | None = None  # (N,) 1.0 on tokens the provenance spans call sampled; None without spans


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]
    error: str = ""  # a datum that could not be read: the request fails in its turn (its seq_id must not stall)


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def decode_forward_backward(body: bytes, content_encoding: str = "") -> ForwardBackwardCall:
    """The protobuf body of /api/v1/forward_backward; `TinkerRequestError` when it cannot be read."""
    pb = _pb()
    if content_encoding.strip().lower() == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise TinkerRequestError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})")
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    try:
        data, error = [_decode_datum(datum, i, pb) for i, datum in enumerate(message.data)], ""
    except TinkerRequestError as exc:
        data, error = [], str(exc)
    return ForwardBackwardCall(
        message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, data, error
    )


def _decode_datum(datum, index: int, pb) -> WireDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise TinkerRequestError(
                f"datum {index}: model_input has a {kind} chunk; this server trains on text only (EncodedTextChunk)"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {
        name: _decode_tensor(tensor, f"datum {index}: loss_fn_inputs[{name!r}]", pb)
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return WireDatum(tokens, inputs, _sampled_mask(datum.loss_fn_input_spans, len(tokens), index))


def _sampled_mask(spans, length: int, index: int) -> np.ndarray | None:
    """Provenance spans (prompt or sampled tokens, in order) as a per-token mask of the sampled ones."""
    if not spans:
        return None
    parts = []
    for span in spans:
        kind = span.WhichOneof("span")
        arm = getattr(span, kind)
        parts.append(np.full(arm.length, 1.0 if kind == "sampled_tokens" else 0.0, dtype=np.float32))
    mask = np.concatenate(parts)
    if mask.size != length:
        raise TinkerRequestError(
            f"datum {index}: loss_fn_input_spans cover {mask.size} tokens but the datum has {length}; they must match"
        )
    return mask


def _decode_tensor(tensor, where: str, pb) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if tensor.dtype not in dtypes:
        raise TinkerRequestError(f"{where}: unsupported dtype {tensor.dtype}; send float32 or int64")
    dtype = dtypes[tensor.dtype]
    shape = tuple(tensor.shape)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1:
            raise TinkerRequestError(f"{where}: a sparse tensor must be 2-D with len(crow_indices) = rows + 1")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, cols] = values
        return dense
    flat = np.frombuffer(tensor.dense, dtype=dtype)
    if not shape:
        shape = (flat.size,)
    if int(np.prod(shape)) != flat.size:
        raise TinkerRequestError(f"{where}: shape {list(shape)} does not hold its {flat.size} values")
    return flat.reshape(shape).copy()


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`tinker_public.ForwardBackwardOutput`: one ArrayRecord with a BatchedTensor per output field (the datums'
    arrays concatenated, byte offsets between them)."""
    pb = _pb()
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    names = sorted({name for output in outputs for name in output})
    for name in names:
        arrays = [np.asarray(output[name]) for output in outputs]
        integer = all(np.issubdtype(a.dtype, np.integer) for a in arrays)
        dtype = np.int64 if integer else np.float32
        arrays = [a.astype(dtype) for a in arrays]
        batched = record.fields[name]
        batched.dtype = pb.DTYPE_INT64 if integer else pb.DTYPE_FLOAT32
        batched.trailing_shape.extend(arrays[0].shape[1:] if arrays and arrays[0].ndim > 1 else [])
        sizes = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched.offsets = sizes.tobytes()
        batched.data = b"".join(a.tobytes() for a in arrays)
    return message.SerializeToString()


@dataclass
class WireSequence:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str  # "stop" | "length"


def encode_sample_response(
    sequences: list[WireSequence],
    prompt_logprobs: list[float | None] | None,
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None,
) -> bytes:
    """`tinker_public.SampleResponse`: tokens as int32 bytes, logprobs as float32 bytes, prompt logprobs with NaN
    where there is none (the first token), top-k prompt logprobs as N x K matrices (empty cells: id 0, -99999)."""
    pb = _pb()
    message = pb.SampleResponse()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for sequence in sequences:
        out = message.sequences.add()
        out.stop_reason = reasons[sequence.stop_reason]
        out.tokens = np.asarray(sequence.tokens, dtype=np.int32).tobytes()
        if sequence.logprobs is not None:
            out.logprobs = np.asarray(sequence.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt_logprobs is not None:
        k = max((len(row) for row in topk_prompt_logprobs if row), default=0)
        ids = np.zeros((len(topk_prompt_logprobs), k), dtype=np.int32)
        values = np.full((len(topk_prompt_logprobs), k), -99999.0, dtype=np.float32)
        for i, row in enumerate(topk_prompt_logprobs):
            for j, (token, logprob) in enumerate(row or []):
                ids[i, j], values[i, j] = token, logprob
        topk = message.topk_prompt_logprobs
        topk.token_ids, topk.logprobs, topk.k, topk.length = ids.tobytes(), values.tobytes(), k, len(ids)
    return message.SerializeToString()
