"""Serving a Hugging Face sequence-classification reward model over HTTP.

This is how a trained reward model is served to the `judge` environment (`mode="reward_model"`),
and `RewardModelScorer` is what that environment runs in-process in `mode="local"`, so both modes
give the same scores.

Protocol (JSON over HTTP):

- `POST /score` with `{"conversations": [[{"role": "user", "content": "..."},
  {"role": "assistant", "content": "..."}], ...]}` answers `{"scores": [0.73, -1.2, ...]}`: one
  float per conversation, in order. A malformed body gets HTTP 422 (FastAPI's validation error).
- `GET /health` answers `{"status": "ok", "model": "<path>"}` once the model is loaded.
- The guards of every reinforge server (network.Guard): with a token (`--token-env`), every route but
  /health answers 401 without `Authorization: Bearer <token>`; a body that is not JSON 415, one over
  64 MiB 413.

Scoring: each conversation is rendered with the tokenizer's chat template
(`apply_chat_template(messages, tokenize=False)`, no generation prompt), tokenized without further
special tokens, cut to its last `max_length` tokens (so the response survives), and right-padded in
micro-batches of `batch_size`. The score is the model's single logit at the last non-pad token
(Hugging Face's pooling for `*ForSequenceClassification`). Padding leaves scores unchanged up to
float rounding (a test holds 1e-5). Forward passes are serialised with a lock; batches come from
within one request, not across concurrent requests.

Run it with `reinforge serve-rm MODEL_DIR --port 8001` (envs/cli.py) or `serve_reward_model(...)`; it
listens on 127.0.0.1 unless told otherwise (`--allow-remote`).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from reinforge.errors import ReinforgeError


class RewardModelScorer:
    """A sequence-classification model with one label that scores chat conversations."""

    def __init__(self, model_path: str, device: str, dtype: str, max_length: int, batch_size: int) -> None:
        from transformers import AutoTokenizer

        from reinforge.modeling import DTYPES

        self.model_path = model_path
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = self._load_model(model_path, DTYPES.get(dtype, dtype))  # auto: as saved
        except OSError as exc:
            raise ReinforgeError(
                f"reward model {model_path}: could not load it ({str(exc).strip().splitlines()[0]})"
            ) from None
        if self.tokenizer.chat_template is None:
            raise ReinforgeError(
                f"reward model {model_path}: its tokenizer has no chat template; save one with the model"
            )
        if self.model.config.num_labels != 1:
            raise ReinforgeError(
                f"reward model {model_path}: num_labels={self.model.config.num_labels}; a reward model has one output"
            )
        self.tokenizer.truncation_side = "left"  # keep the response, which is what is scored
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # the pooling finds the last non-pad token by it
        self.model.to(device).eval()
        self._lock = threading.Lock()

    @staticmethod
    def _load_model(model_path: str, dtype: torch.dtype | str):
        """The classifier in `model_path`; a LoRA reward model's directory (`reinforge rm` with `model.lora`:
        a PEFT adapter and the trained head) is merged onto the base model it names."""
        from transformers import AutoModelForSequenceClassification

        adapter_config = Path(model_path) / "adapter_config.json"
        if not adapter_config.is_file():
            return AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype)
        from peft import PeftModel

        base = json.loads(adapter_config.read_text())["base_model_name_or_path"]
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=dtype)
        return PeftModel.from_pretrained(model, model_path).merge_and_unload()

    @torch.no_grad()
    def score(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        """One score per conversation, in order."""
        texts = [self.tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                add_special_tokens=False,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with self._lock:
                logits_B1 = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            scores += logits_B1[:, 0].float().tolist()
        return scores


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool calls, names: passed to the chat template as they are

    role: str
    content: str


class ScoreRequest(BaseModel):
    conversations: list[list[Message]]


class ScoreResponse(BaseModel):
    scores: list[float]


def create_app(scorer: RewardModelScorer, token: str | None = None):
    """The FastAPI app of the protocol in the module doc; with a `token`, every route but /health wants it
    as `Authorization: Bearer` (the judge sends env.judge.api_key_env's)."""
    from fastapi import FastAPI

    from reinforge.envs.http_server import DEFAULT_MAX_REQUEST_BYTES
    from reinforge.network import Guard

    app = FastAPI(title="reinforge reward model")
    app.add_middleware(Guard, token=token, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, open_paths=("/health",))

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": scorer.model_path}

    @app.post("/score")
    def score(request: ScoreRequest) -> ScoreResponse:  # a plain def: FastAPI runs it off the event loop
        conversations = [[message.model_dump() for message in messages] for messages in request.conversations]
        return ScoreResponse(scores=scorer.score(conversations))

    return app


def serve_reward_model(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8001,
    device: str = "cpu",
    dtype: str = "float32",
    max_length: int = 2048,
    batch_size: int = 8,
    token: str | None = None,
) -> None:
    """Load the model, then serve it until interrupted."""
    import uvicorn

    scorer = RewardModelScorer(model_path, device=device, dtype=dtype, max_length=max_length, batch_size=batch_size)
    print(f"serving reward model {model_path} at http://{host}:{port} on {device}; Ctrl-C stops", flush=True)
    uvicorn.run(create_app(scorer, token), host=host, port=port, log_level="warning")


def main() -> None:
    # the old entry point: one line naming the new one
    moved = "`python -m reinforge.envs.reward_model_server` moved: run `reinforge serve-rm MODEL_DIR`"
    print(f"reinforge: error: {moved}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
