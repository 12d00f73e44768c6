"""Tinker checkpoints in the server's directory: `tinker://<model_id>/weights/<name>` (a training state: weights
and optimizer, resumable) and `tinker://<model_id>/sampler_weights/<name>` (the weights a sampler loads).

Layout under `run_dir`: `<model_id>/weights/<name>/` is a reinforge checkpoint, which `reinforge convert` exports
(a LoRA one as a PEFT adapter, or merged with `--merge`): `trainer/` (the training backend's `save_state`: weights,
with LoRA the adapter's only, AdamW's moments and the schedule, in any layout's format, training/state.py),
`config.yaml` (the model section, base and LoRA settings), `tinker.json` (base model name, LoRA rank and flags,
step, time, user metadata, expiry) and `COMPLETE` (every file's size and SHA-256, written last).
`<model_id>/sampler_weights/<name>/` is a PEFT adapter directory (LoRA) or a Hugging Face model directory (full
weights), which transformers and vLLM load as they are, with its `tinker.json`. Every write is atomic
(run_dir.atomic_directory): a failure leaves the previous checkpoint of that name or none, never half of one. A
checkpoint past its `ttl_seconds` is deleted when next looked at. A path that is malformed, unknown, expired or of
the wrong kind is a one-line `TinkerRequestError`.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml
from tinker import types

from reinforge.model_config import ModelConfig
from reinforge.run_dir import atomic_directory
from reinforge.tinker.engine_slot import SavedWeights
from reinforge.tinker.errors import TinkerRequestError
from reinforge.training.checkpoint import verifies, write_complete

TINKER_FILE = "tinker.json"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a directory name of its own: no "/", no "..", no dot file
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # the SDK's model ids are SESSION:train:N
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # the path's segment -> the SDK's checkpoint_type
SEGMENTS = {kind: segment for segment, kind in KINDS.items()}


@dataclass(frozen=True)
class TrainedModel:
    """What a checkpoint records of the training client whose weights it holds."""

    base_model: str  # the name clients use
    model: ModelConfig  # the trainer's: its `lora` (rank included) for a LoRA client, None for full weights
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None

    @property
    def lora_rank(self) -> int | None:
        return self.model.lora.rank if self.model.lora else None


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as its `tinker.json` and directory say."""

    tinker_path: str
    directory: Path
    checkpoint_type: str  # "training" or "sampler"
    trained: TrainedModel
    step: int
    time: datetime
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None

    def weights_info(self) -> types.WeightsInfoResponse:
        """The answer to /api/v1/weights_info."""
        trained = self.trained
        return types.WeightsInfoResponse(
            base_model=trained.base_model, is_lora=trained.lora_rank is not None, lora_rank=trained.lora_rank,
            train_unembed=trained.train_unembed, train_mlp=trained.train_mlp, train_attn=trained.train_attn,
        )  # fmt: skip

    def checkpoint(self) -> types.Checkpoint:
        """The SDK's record of it, as the checkpoint listings return them."""
        size = sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
        return types.Checkpoint(
            checkpoint_id=self.tinker_path.removeprefix("tinker://").split("/", 1)[1],
            checkpoint_type=self.checkpoint_type, time=self.time, tinker_path=self.tinker_path, size_bytes=size,
            user_metadata=self.user_metadata, expires_at=self.expires_at,
        )  # fmt: skip

    def sampler_weights(self) -> SavedWeights:
        """The weights a sampler serves from this checkpoint (sampler weights only)."""
        if self.checkpoint_type != "sampler":
            raise TinkerRequestError(
                f"{self.tinker_path} is a training state; sample from weights saved with save_weights_for_sampler "
                "(tinker://<model_id>/sampler_weights/<name>)"
            )
        return SavedWeights(self.trained.base_model, self.directory, self.trained.lora_rank)


class Checkpoints:
    """The checkpoints under `run_dir` (the server's directory). Each `backend` argument is a reinforge training
    backend or a TinkerTrainer (its `backend` is used)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.unnamed = itertools.count()

    def save_state(
        self, model_id: str, name: str, backend, trained: TrainedModel, step: int, overwrite: bool = False,
        user_metadata: dict[str, str] | None = None, ttl_seconds: int | None = None,
    ) -> str:  # fmt: skip
        """Write the training backend's state (weights and optimizer) as `tinker://<model_id>/weights/<name>`."""
        path, directory = self._new(model_id, "training", name, overwrite)
        with atomic_directory(directory) as tmp:
            training_backend(backend).save_state(tmp / "trainer")
            model = trained.model.model_dump(mode="json")
            (tmp / "config.yaml").write_text(yaml.safe_dump({"model": model}, sort_keys=False))
            _write_record(tmp, trained, step, user_metadata, ttl_seconds)
            write_complete(tmp, step)
        return path

    def save_for_sampler(
        self, model_id: str, name: str | None, backend, trained: TrainedModel, step: int,
        user_metadata: dict[str, str] | None = None, ttl_seconds: int | None = None,
    ) -> str:  # fmt: skip
        """Write the weights a sampler loads as `tinker://<model_id>/sampler_weights/<name>` (a name of its own when
        None): the PEFT adapter of a LoRA client, else the whole model as a Hugging Face directory. A name saved
        again is replaced (as Tinker's sampler saves are)."""
        name = name or f"sampler-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{next(self.unnamed)}"
        path, directory = self._new(model_id, "sampler", name, overwrite=True)
        with atomic_directory(directory) as tmp:
            backend = training_backend(backend)
            (backend.save_adapter if trained.lora_rank is not None else backend.save_pretrained)(tmp)
            _write_record(tmp, trained, step, user_metadata, ttl_seconds)
        return path

    def load_state(self, path: str, backend, with_optimizer: bool, expected: TrainedModel | None = None):
        """Restore a training state into `backend` (built for the checkpoint's model: `info(path).trained`): its
        weights, and its optimizer's moments and step with `with_optimizer`, else a fresh optimizer. `expected`: the
        client's model, refused when the checkpoint's base or LoRA rank differ. Returns the checkpoint's info."""
        info = self.info(path)
        if info.checkpoint_type != "training":
            raise TinkerRequestError(
                f"{path} holds sampler weights; load a training state saved with save_state "
                "(tinker://<model_id>/weights/<name>)"
            )
        if expected is not None and (expected.base_model, expected.lora_rank) != (
            info.trained.base_model, info.trained.lora_rank,
        ):  # fmt: skip
            raise TinkerRequestError(
                f"{path} holds {_describe(info.trained)}, and this training client is {_describe(expected)}; load it "
                "into a client of the same model (create_training_client_from_state does)"
            )
        if not verifies(info.directory):
            raise TinkerRequestError(f"{path} is damaged: its files do not match their checksums; save it again")
        backend = training_backend(backend)
        backend.load_state(info.directory / "trainer")
        if not with_optimizer:
            reset_optimizer(backend)
        return info

    def info(self, path: str) -> CheckpointInfo:
        """The checkpoint at `path`, or a one-line `TinkerRequestError` saying why there is none."""
        model_id, segment, name = parse_path(path)
        info = self._read(self.run_dir / model_id / segment / name, path)
        if info is None:
            raise TinkerRequestError(
                f"no checkpoint {path} on this server; list_checkpoints('{model_id}') lists those of that model"
            )
        return info

    def list(self, model_id: str | None = None) -> list[types.Checkpoint]:
        """The checkpoints of `model_id` (of every model when None), oldest first."""
        if model_id is not None and not MODEL_ID.match(model_id):
            raise TinkerRequestError(f"malformed model id {model_id!r}")
        infos = []
        for record in sorted(self.run_dir.glob(f"{model_id or '*'}/*/*/{TINKER_FILE}")):
            directory = record.parent
            model, segment, name = directory.parent.parent.name, directory.parent.name, directory.name
            if segment in KINDS and NAME.match(name) and MODEL_ID.match(model):
                info = self._read(directory, f"tinker://{model}/{segment}/{name}")
                infos.extend([info] if info else [])
        return [info.checkpoint() for info in sorted(infos, key=lambda info: info.time)]

    def delete(self, path: str) -> None:
        """Remove the checkpoint at `path` (an unknown one is a `TinkerRequestError`)."""
        shutil.rmtree(self.info(path).directory)

    def _new(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[str, Path]:
        path = f"tinker://{model_id}/{SEGMENTS[kind]}/{name}"
        parse_path(path)
        directory = self.run_dir / model_id / SEGMENTS[kind] / name
        if not overwrite and self._read(directory, path) is not None:
            raise TinkerRequestError(f"{path} exists already; save under another name, or with overwrite=True")
        return path, directory

    def _read(self, directory: Path, path: str) -> CheckpointInfo | None:
        try:
            record = json.loads((directory / TINKER_FILE).read_text())
        except (OSError, ValueError):
            return None
        expires = datetime.fromisoformat(record["expires_at"]) if record.get("expires_at") else None
        if expires is not None and expires <= datetime.now(timezone.utc):
            shutil.rmtree(directory, ignore_errors=True)
            return None
        trained = TrainedModel(
            record["base_model"], ModelConfig(**record["model"]),
            *(record.get(key) for key in ("train_unembed", "train_mlp", "train_attn")),
        )  # fmt: skip
        kind = KINDS[directory.parent.name]
        time = datetime.fromisoformat(record["time"])
        return CheckpointInfo(
            path, directory, kind, trained, record["step"], time, record.get("user_metadata"), expires
        )


def parse_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>` as its three parts, or a one-line error."""
    parts = path.removeprefix("tinker://").split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not MODEL_ID.match(parts[0]) or not NAME.match(parts[2]):
        raise TinkerRequestError(
            f"malformed checkpoint path {path!r}; expected tinker://<model_id>/weights/<name> or "
            "tinker://<model_id>/sampler_weights/<name>, names of letters, digits, '.', '_' and '-'"
        )
    return parts[0], parts[1], parts[2]


def training_backend(trainer):
    """The reinforge training backend of `trainer`: itself, or the `backend` of a TinkerTrainer (tinker/training.py)."""
    return trainer if hasattr(trainer, "save_state") else trainer.backend


def reset_optimizer(backend) -> None:
    """A fresh optimizer for weights loaded without their optimizer state: AdamW's moments and step forgotten."""
    if hasattr(backend, "reset_optimizer"):  # a backend of ranks in other processes says how itself
        return backend.reset_optimizer()
    if not hasattr(backend, "optimizer"):
        raise TinkerRequestError(
            "this server's training backend cannot load weights without their optimizer state; load the state with "
            "its optimizer (create_training_client_from_state_with_optimizer)"
        )
    backend.optimizer.state.clear()


def _write_record(directory: Path, trained: TrainedModel, step: int, user_metadata, ttl_seconds: int | None) -> None:
    now = datetime.now(timezone.utc)
    record = {
        "base_model": trained.base_model,
        "lora_rank": trained.lora_rank,
        "train_unembed": trained.train_unembed,
        "train_mlp": trained.train_mlp,
        "train_attn": trained.train_attn,
        "model": trained.model.model_dump(mode="json"),
        "step": step,
        "time": now.isoformat(),
        "user_metadata": user_metadata,
        "expires_at": (now + timedelta(seconds=ttl_seconds)).isoformat() if ttl_seconds else None,
    }
    (directory / TINKER_FILE).write_text(json.dumps(record, indent=1))


def _describe(trained: TrainedModel) -> str:
    lora = f"a LoRA of rank {trained.lora_rank}" if trained.lora_rank is not None else "full weights"
    return f"{lora} on {trained.base_model}"
