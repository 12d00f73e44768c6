"""What the worker thread does with a queued request: reinforge's training backend (training.py's TinkerTrainer,
losses.py's checks), its sampling engines (sampler.py) and checkpoints (checkpoints.py). Only the worker thread
calls the methods that touch models; the cheap checks (`check_*`, `checkpoint_info`, the limits) run on the HTTP
thread before a request queues."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from reinforge.tinker.config import TinkerServeConfig
from reinforge.tinker.errors import TinkerRequestError, UnknownResource
from reinforge.tinker.wire import (
    ForwardBackwardCall,
    WireSequence,
    encode_forward_backward_output,
    encode_sample_response,
)

logger = logging.getLogger(__name__)

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelEntry:
    """A training client's model."""

    model_id: str
    session_id: str
    base_model: str
    lora: types.LoraConfig | None
    trainer: Any = None  # training.py's TinkerTrainer, once built
    cleanup: Any = None
    version: int = 0  # bumped whenever the weights change (optim_step, load_state): sampler.py's live weights
    model_config: Any = None  # the ModelConfig it was built from (its `lora` with the client's rank)


@dataclass(frozen=True)
class WeightsSpec:
    """Which weights a sampling session samples with: a base model's, a sampler checkpoint's, or a training
    client's live weights as they were after `version` optimizer steps (save_weights_and_get_sampling_client)."""

    base_model: str
    checkpoint: str | None = None
    model: ModelEntry | None = None
    version: int | None = 0  # None: inflight


@dataclass
class SamplerEntry:
    """A sampling session: which weights its samples come from."""

    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None
    weights: WeightsSpec


@dataclass(frozen=True)
class CheckpointInfo:
    """What the service needs of a checkpoint (checkpoints.py's record of it in `record`)."""

    base_model: str
    lora_rank: int | None
    kind: str  # "training" or "sampler"
    record: Any = None

    def lora_config(self) -> types.LoraConfig | None:
        if self.lora_rank is None:
            return None
        trained = self.record.trained
        flags = {k: getattr(trained, k) for k in ("train_mlp", "train_attn", "train_unembed")}
        return types.LoraConfig(rank=self.lora_rank, **{k: v for k, v in flags.items() if v is not None})


class Device:
    def __init__(self, config: TinkerServeConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self._samplers = None
        self._checkpoints = None

    # the base models

    @functools.cache
    def _limits(self, base_model: str):
        from reinforge.modeling import model_limits

        return model_limits(self.config.model_config_for(base_model))

    def max_tokens(self, base_model: str) -> int:
        context = self._limits(base_model).max_positions or 4096
        cap = self.config.tinker.max_sequence_tokens
        return min(cap, context) if cap else context

    def vocab_size(self, base_model: str) -> int | None:
        return self._limits(base_model).vocab_size

    @functools.cache
    def arch(self, base_model: str) -> str:
        from transformers import AutoConfig

        from reinforge.modeling import model_location

        model_config = self.config.model_config_for(base_model)
        hf = AutoConfig.from_pretrained(model_location(model_config), trust_remote_code=model_config.trust_remote_code)
        return hf.model_type

    def tokenizer_id(self, model_config) -> str:
        """What the SDK's `get_tokenizer()` hands AutoTokenizer: the model directory (absolute) or the hub id."""
        from reinforge.modeling import model_location

        location = model_location(model_config)
        return str(Path(location).resolve()) if Path(location).exists() else location

    @functools.cache
    def tokenizer(self, base_model: str):
        from reinforge.modeling import load_tokenizer

        return load_tokenizer(self.config.model_config_for(base_model))

    # training

    def build(self, entry: ModelEntry) -> None:
        from reinforge.model_config import LoraConfig
        from reinforge.tinker.training import build_tinker_backend

        model_config = self.config.model_config_for(entry.base_model)
        rank = None
        if entry.lora is not None:
            rank = entry.lora.rank
            targets = (ATTENTION_MODULES if entry.lora.train_attn else []) + (
                MLP_MODULES if entry.lora.train_mlp else []
            )
            base = model_config.lora or LoraConfig()
            lora = base.model_copy(update={"rank": rank, "target_modules": targets or base.target_modules})
            model_config = model_config.model_copy(update={"lora": lora})
        seed = entry.lora.seed if entry.lora is not None and entry.lora.seed is not None else self.config.seed
        entry.model_config = model_config.model_copy(update={"lora": model_config.lora if rank else None})
        entry.trainer, entry.cleanup = build_tinker_backend(
            model_config, self.config.training, self.config.cluster, rank, seed
        )
        logger.info("model %s built on %s (LoRA rank %s)", entry.model_id, entry.base_model, rank)

    def free(self, entries: list[ModelEntry]) -> None:
        for entry in entries:
            if entry.cleanup is not None:
                entry.cleanup()
            entry.trainer = entry.cleanup = None
            if self._samplers is not None and hasattr(self._samplers, "forget"):
                self._samplers.forget(entry.model_id)
            logger.info("model %s freed", entry.model_id)

    def check_forward(self, entry: ModelEntry, call: ForwardBackwardCall) -> list:
        """The request's datums (losses.py's `Datum`), checked: `TinkerRequestError` names the first problem."""
        from reinforge.tinker.datum import Datum
        from reinforge.tinker.losses import LOSS_NAMES, check_inputs

        limit = self.config.tinker.max_datums_per_request
        if call.error:
            raise TinkerRequestError(call.error)
        if not call.data:
            raise TinkerRequestError("no datums: send at least one")
        if len(call.data) > limit:
            raise TinkerRequestError(f"{len(call.data)} datums in one request; at most {limit}")
        if call.loss_fn not in LOSS_NAMES:
            raise TinkerRequestError(
                f"unknown loss {call.loss_fn!r}: the built-in losses are {', '.join(LOSS_NAMES)} "
                "(a custom loss runs through forward_backward_custom)"
            )
        context, vocab = self.max_tokens(entry.base_model), self.vocab_size(entry.base_model)
        for i, datum in enumerate(call.data):
            n = len(datum.tokens)
            if n == 0:
                raise TinkerRequestError(f"datum {i}: model_input is empty")
            if n > context:
                raise TinkerRequestError(
                    f"datum {i}: {n} tokens exceed the context of {entry.base_model} ({context} tokens); shorten it"
                )
            if vocab is not None and (min(datum.tokens) < 0 or max(datum.tokens) >= vocab):
                raise TinkerRequestError(f"datum {i}: a token id outside the vocabulary [0, {vocab})")
            for name, array in datum.inputs.items():
                if array.ndim == 0 or array.shape[0] != n:
                    raise TinkerRequestError(
                        f"datum {i}: loss_fn_inputs[{name!r}] has length {array.shape[0] if array.ndim else 0} but "
                        f"model_input has {n} tokens; they must be equal (targets are the inputs shifted by one)"
                    )
        datums = [Datum(tokens=list(d.tokens), inputs=dict(d.inputs), sampled=d.sampled) for d in call.data]
        check_inputs(call.loss_fn, call.loss_fn_config, datums)
        return datums

    def forward_backward(self, entry: ModelEntry, call: ForwardBackwardCall, datums: list) -> bytes:
        result = entry.trainer.forward_backward(datums, call.loss_fn, call.loss_fn_config, not call.forward_only)
        outputs = [{k: np.asarray(v) for k, v in output.items()} for output in result.outputs]
        return encode_forward_backward_output(outputs, result.metrics)

    def optim_step(self, entry: ModelEntry, adam: dict[str, float]) -> dict[str, float]:
        from reinforge.tinker.training import AdamStep

        metrics = entry.trainer.optim_step(AdamStep(**adam))
        entry.version += 1
        return {k: float(v) for k, v in (metrics or {}).items()}

    # checkpoints

    @property
    def checkpoints(self):
        if self._checkpoints is None:
            from reinforge.tinker.checkpoints import Checkpoints

            self._checkpoints = Checkpoints(self.run_dir)
        return self._checkpoints

    def _trained(self, entry: ModelEntry):
        from reinforge.tinker.checkpoints import TrainedModel

        lora = entry.lora
        flags = (lora.train_unembed, lora.train_mlp, lora.train_attn) if lora is not None else (None, None, None)
        return TrainedModel(entry.base_model, entry.model_config, *flags)

    def save_state(self, entry: ModelEntry, request: types.SaveWeightsRequest) -> str:
        return self.checkpoints.save_state(
            entry.model_id, request.path, entry.trainer, self._trained(entry), entry.version,
            overwrite=request.overwrite, user_metadata=request.user_metadata, ttl_seconds=request.ttl_seconds,
        )  # fmt: skip

    def save_for_sampler(self, entry: ModelEntry, request: types.SaveWeightsForSamplerRequest) -> str:
        """Write the sampler's weights; sampling them while the client has not trained on comes from memory."""
        from reinforge.tinker.engine_slot import LiveWeights

        path = self.checkpoints.save_for_sampler(
            entry.model_id, request.path, entry.trainer, self._trained(entry), entry.version,
            user_metadata=request.user_metadata, ttl_seconds=request.ttl_seconds,
        )  # fmt: skip
        saved = self.checkpoints.info(path).sampler_weights()
        self.samplers.remember(saved, LiveWeights(entry.base_model, entry, entry.version, _rank(entry)))
        return path

    def load_state(self, entry: ModelEntry, path: str, with_optimizer: bool) -> None:
        self.checkpoints.load_state(path, entry.trainer, with_optimizer, expected=self._trained(entry))
        entry.version += 1

    def checkpoint_info(self, path: str) -> CheckpointInfo:
        """The checkpoint at `path`: a malformed path is a `TinkerRequestError` (400), a missing one
        `UnknownResource` (404)."""
        from reinforge.tinker.checkpoints import parse_path

        parse_path(path)
        try:
            record = self.checkpoints.info(path)
        except TinkerRequestError as exc:
            raise UnknownResource(str(exc)) from None
        return CheckpointInfo(record.trained.base_model, record.trained.lora_rank, record.checkpoint_type, record)

    def has_checkpoints(self, model_id: str) -> bool:
        return bool(self.list_checkpoints(model_id))

    def list_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        return [record.model_dump(mode="json") for record in self.checkpoints.list(model_id)]

    # sampling

    @property
    def samplers(self):
        if self._samplers is None:
            from reinforge.tinker.sampler import Samplers

            self._samplers = Samplers.for_server(self.config, self.tokenizer, self.run_dir)
        return self._samplers

    def live_weights(self, entry: ModelEntry, inflight: bool = False) -> WeightsSpec:
        """The client's weights now (`snapshot`: as they are at this version; `inflight`: whatever they are when
        each sample runs)."""
        return WeightsSpec(entry.base_model, model=entry, version=None if inflight else entry.version)

    def checkpoint_weights(self, path: str) -> WeightsSpec:
        info = self.checkpoint_info(path)
        info.record.sampler_weights()  # a training state is refused here, before a sample queues
        return WeightsSpec(info.base_model, checkpoint=path)

    def base_weights(self, base_model: str) -> WeightsSpec:
        return WeightsSpec(base_model)

    def _engine_weights(self, spec: WeightsSpec):
        """sampler.py's SamplerWeights for `spec`."""
        from reinforge.tinker.engine_slot import BaseWeights, LiveWeights

        if spec.model is not None:
            return LiveWeights(spec.base_model, spec.model, spec.version, _rank(spec.model))
        if spec.checkpoint is not None:
            return self.checkpoint_info(spec.checkpoint).record.sampler_weights()
        return BaseWeights(spec.base_model)

    def check_sample(self, sampler: SamplerEntry, request: types.SampleRequest) -> list[int]:
        tokens: list[int] = []
        for chunk in request.prompt.chunks:
            if not isinstance(chunk, types.EncodedTextChunk):
                raise TinkerRequestError(f"the prompt has a {chunk.type} chunk; this server samples from text only")
            tokens.extend(chunk.tokens)
        if not tokens:
            raise TinkerRequestError("the prompt is empty")
        unsupported = [
            name
            for name, asked in (
                ("topk_sample_logprobs", request.topk_sample_logprobs),
                ("target_prompt_logprobs", request.target_prompt_logprobs is not None),
                ("prompt_alt_tokens_k", request.prompt_alt_tokens_k),
            )
            if asked
        ]
        if unsupported:
            raise TinkerRequestError(f"this server does not serve {', '.join(unsupported)} in a sample request")
        if request.num_samples < 1:
            raise TinkerRequestError(f"num_samples={request.num_samples} must be >= 1")
        context = self.max_tokens(sampler.base_model)
        max_tokens = request.sampling_params.max_tokens or self.config.generation.max_new_tokens
        if len(tokens) + max_tokens > context:
            raise TinkerRequestError(
                f"max_tokens={max_tokens} with a prompt of {len(tokens)} tokens exceeds the context of "
                f"{sampler.base_model} ({context} tokens); lower max_tokens to {max(context - len(tokens), 0)} or less"
            )
        return tokens

    def sample(self, sampler: SamplerEntry, requests: list[types.SampleRequest], prompts: list[list[int]]):
        """The encoded SampleResponse of each request; several requests (equal settings, `_sample_batch_key`) go to
        the engine in one call."""
        from reinforge.tinker.sampler import SampleParams

        request = requests[0]
        params = SampleParams.of(
            request.sampling_params,
            request.prompt_logprobs,
            request.topk_prompt_logprobs,
            request.prompt_logprobs_last_n,
        )
        results = self.samplers.sample(self._engine_weights(sampler.weights), prompts, request.num_samples, params)
        return [
            encode_sample_response(
                [WireSequence(list(s.tokens), list(s.logprobs), s.stop_reason) for s in result.sequences],
                result.prompt_logprobs if request.prompt_logprobs else None,
                result.topk_prompt_logprobs if request.topk_prompt_logprobs else None,
            )
            for result in results
        ]

    def shutdown(self) -> None:
        if self._samplers is not None:
            self._samplers.shutdown()


def _rank(entry: ModelEntry) -> int | None:
    return entry.lora.rank if entry.lora is not None else None
