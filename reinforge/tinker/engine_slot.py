"""One generation engine serving one base model, and the weights it serves: the base model's, a training client's
live weights at a version, or weights saved for the sampler on disk (`SamplerWeights`).

The engine is refitted only when the weights asked for differ from those it holds (`EngineSlot.serve`), the way
loops/refit.py refits a run's engine: merged (the whole weights loaded in place; full fine-tuning, LoRA with the HF
engine, or an adapter of a rank the engine cannot take) or adapter (vLLM's LoRA: the PEFT adapter loaded over the
untouched base). Every refit is verified with the engine's digests (generation/weight_digest.py) unless
`generation.verify_refit_every` is 0: a mismatch raises `RefitMismatch` naming the weight. Serving the base again
after a merged refit reloads the base's weights from its files.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reinforge.generation.base import GenerationBackend, GenerationConfig
from reinforge.generation.weight_digest import adapter_tensors, verify
from reinforge.model_config import ModelConfig
from reinforge.run_dir import atomic_directory
from reinforge.tinker.errors import TinkerRequestError


@dataclass(frozen=True)
class BaseWeights:
    """The base model as it is."""

    base_model: str  # the name clients use


@dataclass(frozen=True)
class SavedWeights:
    """Weights saved for the sampler (checkpoints.py): a PEFT adapter directory or a Hugging Face model directory."""

    base_model: str
    path: Path
    lora_rank: int | None  # None: whole weights


@dataclass(frozen=True, eq=False)
class LiveWeights:
    """A training client's weights as they are in its training backend, at `version`.

    `trainer`: anything with `version` (an int its owner bumps whenever the weights change: each optimizer step,
    each load) and `backend` (a reinforge training backend: `named_weights()`, `save_adapter(path)`), or `trainer`
    whose `backend` that is (tinker/training.py's TinkerTrainer; None once freed). `version` None:
    whatever the trainer holds when a sample runs (Tinker's `inflight` kind); an int: exactly those weights (the
    `snapshot` kind), which can be sampled while the trainer is still at that version or the engine still holds
    them; past that, a one-line `TinkerRequestError`."""

    base_model: str
    trainer: Any
    version: int | None
    lora_rank: int | None


SamplerWeights = BaseWeights | SavedWeights | LiveWeights
BASE = ("base",)
_serials = itertools.count(1)
_trainer_ids: dict[int, int] = {}  # id() of a live trainer -> its number


def trainer_id(trainer) -> int:
    """A number of its own for each trainer object, never reused (an `id()` is, after the object is freed; the
    object may be unhashable, a dataclass)."""
    key = id(trainer)
    if key not in _trainer_ids:
        _trainer_ids[key] = next(_serials)
        weakref.finalize(trainer, _trainer_ids.pop, key, None)
    return _trainer_ids[key]


class EngineSlot:
    """A generation engine for `model` (the base model's config) and what it holds now (`holds`, a key of
    `weights_key`)."""

    def __init__(self, engine: GenerationBackend, model: ModelConfig, generation: GenerationConfig, adapter_dir: Path):
        self.engine, self.model, self.generation = engine, model, generation
        self.adapter_dir = adapter_dir.resolve()  # absolute: a vLLM engine reads it itself
        # vLLM built with LoRA (model.lora.sync adapter or auto): the largest adapter rank it takes
        self.adapter_rank = model.lora.rank if getattr(engine, "lora_enabled", False) and model.lora else None
        self.holds: tuple = BASE
        self.base_intact = True  # the engine's own weights are the base's (an adapter may run over them)
        self.refits = 0

    def weights_key(self, weights: SamplerWeights) -> tuple:
        """What identifies the weights: equal keys, equal weights (a saved directory by its inode and time: one
        saved again under its name is another)."""
        if isinstance(weights, BaseWeights):
            return BASE
        if isinstance(weights, SavedWeights):
            return saved_key(weights)
        current = weights.trainer.version
        return ("live", trainer_id(weights.trainer), current if weights.version is None else weights.version)

    def serve(self, weights: SamplerWeights) -> None:
        """Make the engine serve `weights` (a refit, verified) unless it does already."""
        key = self.weights_key(weights)
        if key == self.holds:
            return
        if isinstance(weights, LiveWeights) and key[2] != weights.trainer.version:
            raise TinkerRequestError(
                f"this sampling client samples the training client's weights of version {key[2]}, which training has "
                f"since replaced (now version {weights.trainer.version}); create a new sampling client with "
                "save_weights_and_get_sampling_client, or keep weights with save_weights_for_sampler(name)"
            )
        self.holds = ("changing",)  # a refit that fails leaves the engine holding nothing known
        if isinstance(weights, BaseWeights):
            self._serve_base()
        elif isinstance(weights, SavedWeights):
            self._serve_saved(weights)
        else:
            self._serve_live(weights)
        self.holds = key

    def _takes_adapter(self, rank: int | None) -> bool:
        return rank is not None and self.adapter_rank is not None and rank <= self.adapter_rank

    def _serve_base(self) -> None:
        if self.base_intact:
            self._drop_adapter()
        else:
            base = self.model.model_copy(update={"lora": None, "adapter": None})
            self._load_merged(_model_weights(base))
            self.base_intact = True

    def _serve_saved(self, weights: SavedWeights) -> None:
        path = weights.path.resolve()  # absolute: a vLLM engine reads it itself
        if (path / "adapter_config.json").is_file():
            if self._takes_adapter(weights.lora_rank):
                return self._load_adapter(path)
            merged = self.model.model_copy(update={"lora": None, "adapter": str(path)})
            return self._load_merged(_model_weights(merged))
        whole = self.model.model_copy(update={"name_or_path": str(path), "lora": None, "adapter": None})
        self._load_merged(_model_weights(whole))

    def _serve_live(self, weights: LiveWeights) -> None:
        backend = live_backend(weights.trainer)
        if self._takes_adapter(weights.lora_rank):
            with atomic_directory(self.adapter_dir) as tmp:
                backend.save_adapter(tmp)
            return self._load_adapter(self.adapter_dir)
        self._load_merged(dict(backend.named_weights()))

    def _load_merged(self, weights: dict[str, torch.Tensor]) -> None:
        self._drop_adapter()
        self.base_intact = False
        self.engine.update_weights(weights.items())
        if self.generation.verify_refit_every > 0:
            self.refits += 1
            sample = dict(columns=self.generation.verify_refit_columns, step=self.refits)
            verify(self.engine.weight_digests(**sample), weights, **sample)

    def _load_adapter(self, path: Path) -> None:
        if not self.base_intact:  # an earlier merged refit overwrote the base the adapter runs over
            self._serve_base()
        self.engine.load_adapter(str(path))
        if self.generation.verify_refit_every > 0:
            expected = adapter_tensors(path, self.model.dtype)
            verify(self.engine.adapter_digests(), expected, what="LoRA adapter")

    def _drop_adapter(self) -> None:
        if getattr(self.engine, "adapter", None) is not None:
            self.engine.clear_adapter()

    def shutdown(self) -> None:
        self.engine.shutdown()


def saved_key(weights: SavedWeights) -> tuple:
    """Saved weights by their directory's path, inode and time: saved again under the same name, they are others."""
    try:
        stat = os.stat(weights.path)
    except OSError:
        raise TinkerRequestError(
            f"the saved weights at {weights.path} are gone; save them again with save_weights_for_sampler"
        ) from None
    return ("saved", str(weights.path), stat.st_ino, stat.st_mtime_ns)


def live_backend(trainer):
    """The training backend of `trainer` (`trainer.backend`, or `trainer.trainer.backend` for a record that holds the
    training client), or a one-line error when the client was freed."""
    backend = getattr(trainer, "backend", None) or getattr(getattr(trainer, "trainer", None), "backend", None)
    if backend is None:
        raise TinkerRequestError(
            "the training client of this sampling client was freed (its session ended); save_weights_for_sampler "
            "keeps weights to sample after"
        )
    return backend


def _model_weights(model: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of `model` (its `adapter` merged in) by Hugging Face name, loaded from its files."""
    from reinforge.modeling import load_model

    return dict(load_model(model).state_dict())
