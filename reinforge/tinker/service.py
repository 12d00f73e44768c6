"""The Tinker service's state and rules, without HTTP (app.py is its adapter): sessions, training clients' models,
sampling sessions, and the admission of every request into the device's queue (futures.py). What a queued request
does on the device is device.py's.

Requests are checked here, before they queue, so that a bad one is answered with a message that names the problem:
a request that is not bound to a training client's order (create_model, create_sampling_session, asample) gets an
HTTP error the SDK raises (`TinkerRequestError` -> 400, ...); a training client's numbered request (forward_backward,
optim_step, save/load) gets a failed future (`tinker.RequestFailedError`) so that its number does not hold up the
client's next requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tinker import types

from reinforge.tinker.config import TinkerServeConfig
from reinforge.tinker.device import Device, ModelEntry, SamplerEntry
from reinforge.tinker.errors import TinkerRequestError, UnknownResource
from reinforge.tinker.futures import FutureStore, Job, Payload, Scheduler
from reinforge.tinker.sessions import Session, Sessions
from reinforge.tinker.wire import ForwardBackwardCall

logger = logging.getLogger(__name__)

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@dataclass
class Registry:
    """What the service holds, by id."""

    models: dict[str, ModelEntry] = field(default_factory=dict)
    samplers: dict[str, SamplerEntry] = field(default_factory=dict)
    freed: dict[str, str] = field(default_factory=dict)  # model id -> why it is gone


class TinkerService:
    def __init__(self, config: TinkerServeConfig, run_dir: Path, token: str | None = None) -> None:
        self.config = config
        self.token = token
        self.futures = FutureStore(config.tinker.result_ttl_s)
        self.scheduler = Scheduler(self.futures, config.tinker.max_queued_requests)
        self.sessions = Sessions(config.tinker.heartbeat_timeout_s, self._closed)
        self.device = Device(config, run_dir)
        self.registry = Registry()
        self.started = time.time()

    def start(self) -> None:
        self.scheduler.start()
        self.sessions.start()

    def stop(self) -> None:
        self.sessions.stop()
        for session in self.sessions.live():
            self.sessions.close(session.session_id, "the server stopped")
        self.scheduler.stop()
        self.device.shutdown()

    # sessions

    def create_session(self, request: types.CreateSessionRequest) -> dict[str, Any]:
        session = self.sessions.create(dict(request.user_metadata or {}))
        return {"type": "create_session", "session_id": session.session_id}

    def _closed(self, session: Session) -> None:
        """A session closed (finished, or its heartbeat lapsed): free its models and sampling sessions."""
        reason = f"session {session.session_id} closed ({session.closed})"
        self.scheduler.drop_session(session.session_id, reason)
        self.futures.drop_session(session.session_id, reason)
        entries = [self.registry.models.pop(m, None) for m in list(session.model_ids)]
        for model_id in session.model_ids:
            self.registry.freed[model_id] = reason
            self.scheduler.forget_model(model_id)
        for sampler_id in session.sampler_ids:
            self.registry.samplers.pop(sampler_id, None)
        freeing = [e for e in entries if e is not None]
        if freeing:  # the worker owns the device: it frees them between two jobs
            self._submit(session.session_id, "free", lambda: self.device.free(freeing), force=True, own_session=False)

    # models

    def create_model(self, request: types.CreateModelRequest) -> dict[str, Any]:
        session = self._session(request.session_id)
        self._check_base_model(request.base_model)
        _check_optimizer(request.optimizer_config)
        lora = request.lora_config
        if lora is not None:
            self._check_lora(lora)
        model_id = f"{session.session_id}:train:{request.model_seq_id}"
        if model_id in self.registry.models:
            raise TinkerRequestError(f"model {model_id} exists already (model_seq_id {request.model_seq_id} reused)")
        entry = ModelEntry(model_id, session.session_id, request.base_model, lora)

        def run() -> Payload:
            self.device.build(entry)
            return Payload({"type": "create_model", "model_id": model_id})

        return self._ordered(session, entry, run, "create_model", 0)

    def _ordered(self, session: Session, entry: ModelEntry, run: Callable[[], Payload], kind: str, seq: int):
        """Register a new model whose first request (seq `seq`) is `run`; a model that fails to build is forgotten."""

        def first() -> Payload:
            try:
                return run()
            except Exception:
                self.registry.models.pop(entry.model_id, None)
                session.model_ids.discard(entry.model_id)
                self.scheduler.forget_model(entry.model_id)
                self.device.free([entry])
                raise

        self.registry.models[entry.model_id] = entry
        session.model_ids.add(entry.model_id)
        self.scheduler.register_model(entry.model_id, seq)
        future = self._submit(session.session_id, kind, first, model_id=entry.model_id, seq_id=seq)
        return {**future, "model_id": entry.model_id}

    def get_info(self, model_id: str) -> dict[str, Any]:
        entry = self.model(model_id)
        base = self.config.model_config_for(entry.base_model)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": self.device.arch(entry.base_model),
                "model_name": entry.base_model,
                "tokenizer_id": self.device.tokenizer_id(base),
            },
            "is_lora": entry.lora is not None,
            "lora_rank": entry.lora.rank if entry.lora is not None else None,
            "model_name": entry.base_model,
        }

    def model(self, model_id: str) -> ModelEntry:
        entry = self.registry.models.get(model_id)
        if entry is None:
            why = self.registry.freed.get(model_id)
            raise UnknownResource(
                f"unknown model id {model_id!r}"
                + (f": it was freed when its {why}" if why else "")
                + "; create a training client first"
            )
        self.sessions.heartbeat(entry.session_id)
        return entry

    def forward_backward(self, call: ForwardBackwardCall) -> dict[str, Any]:
        entry = self.model(call.model_id)
        kind = "forward" if call.forward_only else "forward_backward"
        return self._numbered(
            entry,
            call.seq_id,
            kind,
            lambda: self.device.check_forward(entry, call),
            lambda datums: Payload(self.device.forward_backward(entry, call, datums)),
        )

    def optim_step(self, request: types.OptimStepRequest) -> dict[str, Any]:
        entry = self.model(request.model_id)

        def check() -> dict[str, float]:
            params = request.optim_params
            if not isinstance(params, types.AdamParams):
                raise TinkerRequestError(
                    f"optim_step: optimizer {getattr(params, 'type', '?')!r} is not served; send AdamParams"
                )
            return _check_adam(params)

        return self._numbered(
            entry,
            request.seq_id,
            "optim_step",
            check,
            lambda adam: Payload({"metrics": self.device.optim_step(entry, adam)}),
        )

    def save_weights(self, request: types.SaveWeightsRequest) -> dict[str, Any]:
        entry = self.model(request.model_id)
        return self._numbered(
            entry,
            request.seq_id,
            "save_weights",
            lambda: _checkpoint_name(request.path),
            lambda name: Payload({"type": "save_weights", "path": self.device.save_state(entry, request)}),
        )

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        entry = self.model(request.model_id)

        def run(name: str | None) -> Payload:
            if name is not None:
                path = self.device.save_for_sampler(entry, request)
                return Payload({"type": "save_weights_for_sampler", "path": path})
            # save_weights_and_get_sampling_client: a sampling session on the live weights, no checkpoint on disk
            sampler = SamplerEntry(
                f"{entry.session_id}:sample:{request.sampling_session_seq_id}",
                entry.session_id,
                entry.base_model,
                None,
                self.device.live_weights(entry, request.kind == "inflight"),
            )
            self._add_sampler(sampler)
            return Payload({"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})

        check = (lambda: _checkpoint_name(request.path)) if request.path is not None else (lambda: None)
        return self._numbered(entry, request.seq_id, "save_weights_for_sampler", check, run)

    def load_weights(self, request: types.LoadWeightsRequest) -> dict[str, Any]:
        if request.session_id is not None:  # create-via-load: a new training client from a checkpoint
            return self._create_from_state(request)
        entry = self.model(request.model_id or "")

        def check() -> str:
            info = self.device.checkpoint_info(request.path)
            if (info.base_model, info.lora_rank) != (entry.base_model, entry.lora.rank if entry.lora else None):
                raise TinkerRequestError(
                    f"load_state: {request.path} holds {info.base_model} (LoRA rank {info.lora_rank}), this model is "
                    f"{entry.base_model} (LoRA rank {entry.lora.rank if entry.lora else None})"
                )
            return request.path

        def run(path: str) -> Payload:
            self.device.load_state(entry, path, request.optimizer)
            return Payload({"type": "load_weights", "path": path, "model_id": entry.model_id})

        return self._numbered(entry, request.seq_id, "load_weights", check, run)

    def _create_from_state(self, request: types.LoadWeightsRequest) -> dict[str, Any]:
        session = self._session(request.session_id or "")
        info = self.device.checkpoint_info(request.path)
        base_model = request.base_model or info.base_model
        self._check_base_model(base_model)
        if request.optimizer_config is not None:
            _check_optimizer(request.optimizer_config)
        if info.kind != "training":
            raise TinkerRequestError(
                f"{request.path} holds sampler weights; a training client starts from a state saved with save_state"
            )
        lora = info.lora_config()
        model_id = f"{session.session_id}:train:{request.model_seq_id}"
        entry = ModelEntry(model_id, session.session_id, base_model, lora)

        def run() -> Payload:
            self.device.build(entry)
            self.device.load_state(entry, request.path, request.optimizer)
            return Payload({"type": "load_weights", "path": request.path, "model_id": model_id})

        return self._ordered(session, entry, run, "load_weights", 0)

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        return self.device.checkpoint_info(tinker_path).record.weights_info().model_dump(mode="json")

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.registry.models and not self.device.has_checkpoints(model_id):
            raise UnknownResource(f"unknown model id {model_id!r}: no training client or checkpoint of that id")
        return {"checkpoints": self.device.list_checkpoints(model_id), "cursor": None}

    def _numbered(self, entry: ModelEntry, seq_id: int | None, kind: str, check, run) -> dict[str, Any]:
        """Queue a training client's request number `seq_id`: `check()` now (its TinkerRequestError fails the
        future at once and frees the number), `run(check's result)` on the worker in the model's order."""
        try:
            checked = check()
        except TinkerRequestError as exc:
            request_id = self.futures.create(entry.session_id)
            self.futures.fail(request_id, f"{kind}: {' '.join(str(exc).split())}")
            self.scheduler.skip(entry.model_id, seq_id)
            return {"request_id": request_id, "model_id": entry.model_id}
        future = self._submit(entry.session_id, kind, lambda: run(checked), model_id=entry.model_id, seq_id=seq_id)
        return {**future, "model_id": entry.model_id}

    # sampling

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest) -> dict[str, Any]:
        session = self._session(request.session_id)
        sampler_id = f"{session.session_id}:sample:{request.sampling_session_seq_id}"
        if request.model_path:
            weights = self.device.checkpoint_weights(request.model_path)
            sampler = SamplerEntry(sampler_id, session.session_id, weights.base_model, request.model_path, weights)
        elif request.base_model:
            self._check_base_model(request.base_model)
            sampler = SamplerEntry(
                sampler_id, session.session_id, request.base_model, None, self.device.base_weights(request.base_model)
            )
        else:
            raise TinkerRequestError("create_sampling_session needs a model_path or a base_model")
        self._add_sampler(sampler)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _add_sampler(self, sampler: SamplerEntry) -> None:
        self.registry.samplers[sampler.sampler_id] = sampler
        self.sessions.get(sampler.session_id).sampler_ids.add(sampler.sampler_id)

    def sampler(self, sampler_id: str) -> SamplerEntry:
        sampler = self.registry.samplers.get(sampler_id)
        if sampler is None:
            raise UnknownResource(f"unknown sampling session {sampler_id!r}; create a sampling client first")
        return sampler

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        sampler = self.sampler(sampler_id)
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def asample(self, request: types.SampleRequest) -> dict[str, Any]:
        if request.sampling_session_id:
            sampler = self.sampler(request.sampling_session_id)
            session_id = sampler.session_id
            self.sessions.heartbeat(session_id)
        else:  # a stateless sample: a base model or a checkpoint named in the request
            sampler = self._one_off_sampler(request)
            session_id = "__stateless__"
        prompt = self.device.check_sample(sampler, request)
        future = self._submit(
            session_id, "sample", lambda: Payload(self.device.sample(sampler, [request], [prompt])[0]),
            batch_key=_sample_batch_key(sampler, request), args=(request, prompt),
            run_batch=lambda jobs: [Payload(body) for body in self.device.sample(
                sampler, [job.args[0] for job in jobs], [job.args[1] for job in jobs])],
        )  # fmt: skip
        ids = [f"{future['request_id']}:{i}" for i in range(request.num_samples)]
        return {**future, "sample_sequence_ids": ids}

    def _one_off_sampler(self, request: types.SampleRequest) -> SamplerEntry:
        if request.model_path:
            weights = self.device.checkpoint_weights(request.model_path)
            return SamplerEntry("", "", weights.base_model, request.model_path, weights)
        if request.base_model:
            self._check_base_model(request.base_model)
            return SamplerEntry("", "", request.base_model, None, self.device.base_weights(request.base_model))
        raise TinkerRequestError("asample needs a sampling_session_id, a model_path or a base_model")

    # the pieces

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": name,
                    "max_context_length": self.device.max_tokens(name),
                    "trainable": True,
                    "sampleable": True,
                }
                for name in self.config.served_models()
            ]
        }

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        self.sessions.heartbeat(session_id)
        return session

    def _submit(
        self, session_id: str, kind: str, run, model_id=None, seq_id=None, force=False, own_session=True, **batch
    ) -> dict[str, Any]:
        request_id = self.futures.create(session_id if own_session else "__server__")
        job = Job(request_id, session_id if own_session else "__server__", run, model_id, seq_id, kind, **batch)
        try:
            self.scheduler.submit(job, force=force)
        except TinkerRequestError:
            self.futures.fail(request_id, "not queued")
            raise
        return {"request_id": request_id}

    def _check_base_model(self, name: str) -> None:
        served = self.config.served_models()
        if name not in served:
            raise TinkerRequestError(
                f"unknown base model {name!r}: this server serves {', '.join(repr(n) for n in served)} "
                "(tinker.base_models in its config)"
            )

    def _check_lora(self, lora: types.LoraConfig) -> None:
        limit = self.config.tinker.max_lora_rank
        if not 1 <= lora.rank <= limit:
            raise TinkerRequestError(
                f"LoRA rank {lora.rank} is out of range: this server takes 1 to {limit} (tinker.max_lora_rank)"
            )
        if not (lora.train_attn or lora.train_mlp):
            raise TinkerRequestError("LoRA with train_attn=False and train_mlp=False trains nothing; set one")


def _sample_batch_key(sampler: SamplerEntry, request: types.SampleRequest) -> tuple | None:
    """Samples of one sampling session with the same settings share an engine call (the RL loop's prompts of a
    step); a seeded request runs alone, so that its seed alone decides its samples."""
    if not sampler.sampler_id or request.sampling_params.seed is not None:
        return None
    return (
        sampler.sampler_id, request.num_samples, request.sampling_params.model_dump_json(),
        request.prompt_logprobs, request.topk_prompt_logprobs, request.prompt_logprobs_last_n,
    )  # fmt: skip


def _check_optimizer(optimizer: Any) -> None:
    kind = getattr(optimizer, "type", "adamw")
    if kind != "adamw":
        raise TinkerRequestError(f"optimizer {kind!r} is not served: this server trains with AdamW only (type adamw)")


def _check_adam(params: types.AdamParams) -> dict[str, float]:
    checks = [
        (params.learning_rate >= 0, f"learning_rate={params.learning_rate} must be >= 0"),
        (0 <= params.beta1 < 1, f"beta1={params.beta1} must be in [0, 1)"),
        (0 <= params.beta2 < 1, f"beta2={params.beta2} must be in [0, 1)"),
        (params.eps > 0, f"eps={params.eps} must be > 0"),
        (params.weight_decay >= 0, f"weight_decay={params.weight_decay} must be >= 0"),
        (params.grad_clip_norm >= 0, f"grad_clip_norm={params.grad_clip_norm} must be >= 0 (0: no clipping)"),
    ]
    bad = [message for ok, message in checks if not ok]
    if bad:
        raise TinkerRequestError("bad AdamParams: " + "; ".join(bad))
    return {name: float(getattr(params, name)) for name in ADAM_FIELDS}


def _checkpoint_name(name: str | None) -> str:
    if not name:
        raise TinkerRequestError("a checkpoint needs a name (save_state(name=...))")
    if "/" in name or name in (".", "..") or not name.isprintable():
        raise TinkerRequestError(f"checkpoint name {name!r} must be one path segment (no '/')")
    return name
