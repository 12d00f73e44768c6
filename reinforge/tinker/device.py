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
    version: int = 0  # optimizer steps taken


@dataclass(frozen=True)
class WeightsSpec:
    """Which weights a sampling session samples with: a base model's, a sampler checkpoint's, or a training
    client's live weights as they were after `version` optimizer steps (save_weights_and_get_sampling_client)."""

    base_model: str
    checkpoint: str | None = None
    model: ModelEntry | None = None
    version: int = 0


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
    base_model: str
    lora_rank: int | None


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

    def save_state(self, entry: ModelEntry, name: str) -> str:
        return self.checkpoints.save_state(entry.model_id, name, entry.trainer, entry.base_model, _rank(entry))

    def save_for_sampler(self, entry: ModelEntry, name: str) -> str:
        return self.checkpoints.save_for_sampler(entry.model_id, name, entry.trainer, entry.base_model, _rank(entry))

    def load_state(self, entry: ModelEntry, path: str, with_optimizer: bool) -> None:
        self.checkpoints.load_state(path, entry.trainer, with_optimizer)

    def checkpoint_info(self, path: str, sampler: bool = False) -> CheckpointInfo:
        """The checkpoint's base model and LoRA rank; `UnknownResource` when there is none at `path`."""
        if not path.startswith("tinker://"):
            raise TinkerRequestError(f"{path!r} is not a tinker:// path (tinker://MODEL_ID/weights/NAME)")
        try:
            info = self.checkpoints.info(path)
        except (FileNotFoundError, KeyError, ValueError) as exc:
            raise UnknownResource(f"no checkpoint at {path}: {' '.join(str(exc).split())}") from None
        base_model, rank = (info[0], info[1]) if isinstance(info, tuple) else (info.base_model, info.lora_rank)
        return CheckpointInfo(base_model, rank)

    def has_checkpoints(self, model_id: str) -> bool:
        return bool(self.list_checkpoints(model_id))

    def list_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        records = self.checkpoints.list(model_id)
        return [r if isinstance(r, dict) else r.model_dump(mode="json") for r in records]

    # sampling

    @property
    def samplers(self):
        if self._samplers is None:
            from reinforge.tinker.sampler import Samplers

            self._samplers = Samplers(self.config, self.tokenizer)
        return self._samplers

    def live_weights(self, entry: ModelEntry) -> WeightsSpec:
        return WeightsSpec(entry.base_model, model=entry, version=entry.version)

    def checkpoint_weights(self, path: str) -> WeightsSpec:
        return WeightsSpec(self.checkpoint_info(path, sampler=True).base_model, checkpoint=path)

    def base_weights(self, base_model: str) -> WeightsSpec:
        return WeightsSpec(base_model)

    def _engine_weights(self, spec: WeightsSpec):
        """sampler.py's SamplerWeights for `spec`."""
        from reinforge.tinker.sampler import SamplerWeights

        if spec.model is not None:
            if spec.model.trainer is None:
                raise TinkerRequestError(f"the training client {spec.model.model_id} of this sampler was freed")
            return SamplerWeights.live(spec.base_model, spec.model.trainer, spec.version)
        if spec.checkpoint is not None:
            return SamplerWeights.checkpoint(spec.checkpoint, self.checkpoints)
        return SamplerWeights.base(spec.base_model)

    def check_sample(self, sampler: SamplerEntry, request: types.SampleRequest) -> list[int]:
        tokens: list[int] = []
        for chunk in request.prompt.chunks:
            if not isinstance(chunk, types.EncodedTextChunk):
                raise TinkerRequestError(f"the prompt has a {chunk.type} chunk; this server samples from text only")
            tokens.extend(chunk.tokens)
        if not tokens:
            raise TinkerRequestError("the prompt is empty")
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

    def sample(self, sampler: SamplerEntry, request: types.SampleRequest, prompt: list[int]) -> bytes:
        from reinforge.tinker.sampler import SampleParams

        params = request.sampling_params
        result = self.samplers.sample(
            self._engine_weights(sampler.weights),
            [prompt],
            request.num_samples,
            SampleParams(
                max_tokens=params.max_tokens or self.config.generation.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                stop=params.stop,
                prompt_logprobs=bool(request.prompt_logprobs),
            ),
        )[0]
        sequences = [WireSequence(list(s.tokens), list(s.logprobs), s.stop_reason) for s in result]
        prompt_logprobs = getattr(result[0], "prompt_logprobs", None) if request.prompt_logprobs and result else None
        return encode_sample_response(sequences, prompt_logprobs)

    def shutdown(self) -> None:
        if self._samplers is not None:
            self._samplers.shutdown()


def _rank(entry: ModelEntry) -> int | None:
    return entry.lora.rank if entry.lora is not None else None
