"""`reinforge serve-tinker`'s config: the base model and how it trains and samples (the recipes' own sections), and
the service's settings (`tinker:`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from reinforge.cluster.config import ClusterConfig
from reinforge.config.section import Section
from reinforge.generation.base import GenerationConfig
from reinforge.model_config import ModelConfig
from reinforge.network import is_loopback
from reinforge.training.base import TrainingConfig


class TinkerConfig(Section):
    """The service: where it listens, who may call it, what it serves, how long it waits for a silent client."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs `allow_remote` and a token (`token_env`)."""
    port: int = 8100
    """TCP port (0 picks a free one; the URL is printed when the server is up)."""
    allow_remote: bool = False
    """Allow a `host` other than loopback: the service then serves other machines, so it needs a token."""
    token_env: str = ""
    """Name of the environment variable holding the API key clients must send (the SDK's TINKER_API_KEY, which
    starts with `tml-`); empty: on loopback any `tml-` key is accepted."""
    base_models: dict[str, str] = {}
    """The base models clients may name (`create_lora_training_client(base_model=NAME)`), name -> model directory or
    hub id; each is loaded with `model`'s other settings (dtype, LoRA alpha, ...). Empty: `model.name_or_path` under
    its own name."""
    run_dir: str = ""
    """Where checkpoints (save_state, save_weights_for_sampler) are written; empty: runs/tinker-<date-time>."""
    heartbeat_timeout_s: float = Field(default=120.0, gt=0)
    """A session none of whose heartbeats (the SDK sends one every 10 s) arrived for this long is closed: its
    training clients' models and its sampling sessions are freed, its queued requests fail."""
    max_queued_requests: int = Field(default=256, ge=1)
    """Most requests waiting for the device (training and sampling together); one more is answered 429, which the
    SDK retries after a back-off."""
    max_datums_per_request: int = Field(default=1024, ge=1)
    """Most datums in one forward/forward_backward request (the SDK splits larger batches into chunks of its
    `fwdbwd_max_chunk_len`, which the server sets to this)."""
    max_sequence_tokens: int = Field(default=0, ge=0)
    """Longest datum or prompt + completion, in tokens; 0: the base model's context (max_position_embeddings)."""
    max_lora_rank: int = Field(default=128, ge=1)
    """Largest LoRA rank a client may ask for."""
    max_request_bytes: int = Field(default=64 << 20, ge=1)
    """Largest request body accepted; larger ones get HTTP 413."""
    retrieve_wait_s: float = Field(default=20.0, gt=0)
    """How long a `retrieve_future` poll waits for its request to finish before answering `try_again` (the SDK polls
    again at once, so waiting here spares both sides a busy loop)."""
    result_ttl_s: float = Field(default=600.0, gt=0)
    """How long a finished request's result is kept after it was first retrieved (the SDK may poll again after a
    dropped connection)."""

    @model_validator(mode="after")
    def _check(self) -> "TinkerConfig":
        if not 0 <= self.port <= 65535:
            raise ValueError(f"tinker.port={self.port} must be in [0, 65535] (0: a free port)")
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(f"tinker.host={self.host} is not loopback; set tinker.allow_remote=true (and a token)")
        if self.allow_remote and not is_loopback(self.host) and not self.token_env:
            raise ValueError(
                f"tinker.host={self.host} with allow_remote needs a token: set tinker.token_env to the name of an "
                "environment variable holding it (anyone who reaches the server could train and sample otherwise)"
            )
        return self


class TinkerServeConfig(Section):
    """The whole server: `reinforge serve-tinker [CONFIG.yaml] [key=value ...]`."""

    seed: int = 0
    """Seed of LoRA initialisation when a client gives none, and of the generation engine."""
    model: ModelConfig = ModelConfig()
    """The default base model (served under its path unless `tinker.base_models` names others) and the settings
    every base model loads with; `model.lora` gives LoRA's alpha, dropout and target modules (the rank comes with
    each request)."""
    training: TrainingConfig = TrainingConfig()
    """The training backend every training client's model runs on: torch or fsdp2, its parallel layout, micro
    batches (`micro_batch_tokens`)."""
    generation: GenerationConfig = GenerationConfig()
    """The sampling engine (hf or vllm) and its settings; a request's sampling parameters override temperature,
    top_p, top_k and the length."""
    cluster: ClusterConfig = ClusterConfig()
    """torch's threads; with `training.backend=fsdp2`, the Ray cluster the ranks run on."""
    tinker: TinkerConfig = TinkerConfig()
    """The service: address, API key, base models, heartbeat timeout, queue bound."""

    def served_models(self) -> dict[str, str]:
        """Base model name -> model directory or hub id."""
        return dict(self.tinker.base_models) or {self.model.name_or_path: self.model.name_or_path}

    def model_config_for(self, base_model: str) -> ModelConfig:
        """`model` with the path of the named base model."""
        return self.model.model_copy(update={"name_or_path": self.served_models()[base_model]})
