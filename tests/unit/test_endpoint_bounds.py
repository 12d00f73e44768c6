"""The endpoint's bounds against clients and files from elsewhere: a bounded request queue (one request beyond it
is HTTP 429 with Retry-After, never an unbounded queue), no remote endpoint without a token."""

import threading
import time

import pytest
from fastapi.testclient import TestClient

from reinforge.errors import ConfigError
from reinforge.generation.base import GenerationResult, SamplingParams
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.network import check_bind_address
from reinforge.paths import PROJECT_ROOT
from reinforge.serving.app import build_app
from reinforge.serving.batcher import Batcher
from reinforge.serving.config import ServingConfig
from reinforge.serving.errors import QueueFull
from reinforge.serving.protocol import ChatCompletionRequest
from reinforge.serving.server import PolicyServer

HELLO = [{"role": "user", "content": "2 + 2?"}]
PARAMS = SamplingParams(max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=-1, seed=0)


class GatedEngine:
    """An engine whose calls wait at a gate, so that requests pile up behind the one it is generating."""

    def __init__(self):
        self.entered, self.gate = threading.Event(), threading.Event()

    def generate(self, prompts, params):
        self.entered.set()
        self.gate.wait(60)
        return GenerationResult(completions=[[] for _ in prompts])


def test_the_batcher_refuses_a_request_beyond_its_queue_and_takes_one_again_once_it_drains():
    engine = GatedEngine()
    batcher = Batcher(engine, max_batch_size=1, batch_wait_s=0, request_timeout_s=60, max_queued=2)
    try:
        first = batcher.submit([1, 2], PARAMS)
        assert engine.entered.wait(30)  # in the engine: no longer queued
        queued = [batcher.submit([1, 2], PARAMS) for _ in range(2)]
        with pytest.raises(QueueFull, match="2 requests are already waiting") as refused:
            batcher.submit([1, 2], PARAMS)
        assert refused.value.retry_after_s == 1  # no engine call has finished yet: at least a second
        engine.gate.set()
        for future in [first, *queued]:
            future.result(30)
        batcher.submit([1, 2], PARAMS).result(30)  # drained: admitted again
    finally:
        engine.gate.set()
        batcher.close()


def test_the_route_answers_a_request_beyond_the_queue_with_429_and_retry_after():
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo")))
    engine = GatedEngine()
    config = ServingConfig(batch_wait_s=0, max_batch_size=1, max_queued_requests=1)
    server = PolicyServer(engine, tokenizer, config, max_model_len=64, default_max_tokens=2, managed=False)
    try:
        server.admit(ChatCompletionRequest(messages=HELLO), None)
        assert engine.entered.wait(30)
        server.admit(ChatCompletionRequest(messages=HELLO), None)  # the one the queue holds
        with TestClient(build_app(server)) as client:
            response = client.post("/v1/chat/completions", json={"messages": HELLO})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_exceeded"
        assert "max_queued_requests" in response.json()["error"]["message"]
    finally:
        engine.gate.set()
        time.sleep(0.1)
        server.stop()


def test_a_remote_endpoint_without_a_token_is_refused():
    check_bind_address("0.0.0.0", allow_remote=True, token="secret")  # remote, with a token: served
    check_bind_address("127.0.0.1", allow_remote=False, token=None)  # loopback needs none
    with pytest.raises(ConfigError, match="--allow-remote --host 0.0.0.0 without a token"):
        check_bind_address("0.0.0.0", allow_remote=True, token=None)
    with pytest.raises(ValueError, match="host=0.0.0.0 with allow_remote needs a token"):
        ServingConfig(host="0.0.0.0", allow_remote=True)
    ServingConfig(host="0.0.0.0", allow_remote=True, token_env="ENDPOINT_TOKEN")
    with pytest.raises(ValueError, match="max_queued_requests must be >= 1"):
        ServingConfig(max_queued_requests=0)


def test_serve_with_allow_remote_and_no_token_is_one_line(capsys):
    from reinforge.cli import main

    assert main(["serve", "--model", "models/demo", "--host", "0.0.0.0", "--allow-remote"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("reinforge: error: --allow-remote --host 0.0.0.0 without a token")
