"""The demo's data as a Tinker user's loop builds it, and a reinforge Tinker server for tests (on a thread of the
test's process, port 0)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer

from reinforge.config.loader import load_recipe_config
from reinforge.tinker.cli import start_server
from reinforge.tinker.config import TinkerServeConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = "demo"  # the name the test server serves models/demo under


@contextlib.contextmanager
def tinker_server(run_dir: Path, *overrides: str, api_key: str = "tml-test"):
    """A server of models/demo (as `demo`) with the SDK's environment pointed at it; yields the RunningServer."""
    config = load_recipe_config(
        TinkerServeConfig,
        ROOT / "configs" / "tinker_demo.yaml",
        [
            "tinker.port=0",
            f"tinker.run_dir={run_dir}",
            f"tinker.base_models={{{BASE}: {ROOT / 'models/demo'}}}",
            *overrides,
        ],
    )
    server = start_server(config)
    saved = {k: os.environ.get(k) for k in ("TINKER_BASE_URL", "TINKER_API_KEY", "TINKER_TELEMETRY")}
    os.environ.update(TINKER_BASE_URL=server.url, TINKER_API_KEY=api_key, TINKER_TELEMETRY="0")
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def tokenizer():
    return AutoTokenizer.from_pretrained(ROOT / "models/demo")


def sft_datums(tok, count: int) -> list[types.Datum]:
    """The first `count` demo chats, each a datum whose weights are 1 on the assistant's answer only."""
    datums = []
    for line in (ROOT / "data/demo/sft.jsonl").read_text().splitlines()[:count]:
        messages = json.loads(line)["messages"]
        prompt = chat_ids(tok, messages[:-1], add_generation_prompt=True)
        full = chat_ids(tok, messages)
        weights = [0.0] * len(prompt) + [1.0] * (len(full) - len(prompt))
        datums.append(supervised_datum(full, weights))
    return datums


def chat_ids(tok, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def supervised_datum(tokens: list[int], weights: list[float]) -> types.Datum:
    """Position i predicts token i + 1 (the cookbook's convention)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.asarray(weights[1:], dtype=np.float32)),
        },
    )


def mean_token_loss(result: types.ForwardBackwardOutput, datums: list[types.Datum]) -> float:
    tokens = sum(float(np.sum(d.loss_fn_inputs["weights"].to_numpy())) for d in datums)
    return result.metrics["loss:sum"] / tokens


def math_prompts(tok, count: int, offset: int = 0) -> list[tuple[list[int], dict]]:
    """Demo arithmetic prompts rendered with the chat template, with their records."""
    lines = (ROOT / "data/demo/train.jsonl").read_text().splitlines()[offset : offset + count]
    records = [json.loads(line) for line in lines]
    return [(chat_ids(tok, [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True), r) for r in records]


def service_client() -> tinker.ServiceClient:
    return tinker.ServiceClient()
