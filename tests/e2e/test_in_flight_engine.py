"""In-flight generation (generation/in_flight.py) on the real HF and vLLM engines: new weights loaded while
sequences are being generated. An update forced in the middle of the generations gives sequences whose tokens come
from two policy versions (the demo model, then the demo's teacher: same architecture, other weights), and every
token's logprob is what its version gives it, to 1e-5, against a hand-built reference that runs the two models
token by token: with the KV cache kept, each forward continues from the keys and values that the weights of their
own time computed; with vLLM's recompute, each token's logits are a fresh forward of its version over everything
before it. vLLM's engine is its `AsyncLLM` (generation/vllm_async.py), started from a fresh process (it sets up
process-wide state), its engine core in a process of its own, its weights sent over the refit's wire by a sender on
a thread of the test's process."""

import json
import threading
import time

import pytest
import torch
from _fresh import run_in_fresh_process
from transformers import AutoModelForCausalLM

from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.generation.base import SamplingParams
from reinforge.generation.in_flight import InFlightEngine
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

MODELS = [PROJECT_ROOT / "models" / "demo", PROJECT_ROOT / "models" / "demo_teacher"]  # versions 0 and 1
PARAMS = SamplingParams(max_new_tokens=48, temperature=1.0, num_samples=2, seed=3)


def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(MODELS[0])))
    records = read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:4]
    return [render_prompt(r, tokenizer, "prompt", None, True).token_ids for r in records]


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def generate_with_an_update(engine, update, update_after_steps: int) -> list[dict]:
    """`PARAMS`' samples of `prompts()` while the teacher's weights are loaded as version 1 (`update(weights,
    version)`), once the engine (an `InFlightEngine` or an `AsyncVLLMEngine`) has taken `update_after_steps` more
    decoding steps."""
    teacher = load(MODELS[1]).state_dict()  # ready before the generation starts: the update lands mid-sequence
    result, start = {}, engine.decoding_steps
    worker = threading.Thread(target=lambda: result.update(out=engine.generate(prompts(), PARAMS)))
    worker.start()
    deadline = time.monotonic() + 60
    while engine.decoding_steps < start + update_after_steps and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    update(teacher, 1)
    worker.join(timeout=120)
    assert "out" in result, "the generation failed or did not end"
    return [
        {"prompt": p, "tokens": c.token_ids, "logprobs": c.logprobs, "versions": c.token_versions}
        for p, group in zip(prompts(), result["out"].completions)
        for c in group
    ]


@torch.no_grad()
def reference_logprobs(models, prompt: list[int], tokens: list[int], versions: list[int], kv_cache: str) -> list[float]:
    """Each token's logprob (temperature 1) as an engine that switched weights at the token versions computes it.
    "keep": token i's logits come from the forward of its input (the prompt for token 0, token i - 1 after) by
    version `versions[i]`, over the cache the earlier forwards left; "recompute": a fresh forward of that version
    over the prompt and tokens[:i]."""
    out = []
    if kv_cache == "recompute":
        full = torch.tensor([prompt + tokens])
        logits = {v: models[v](full).logits[0].log_softmax(-1) for v in set(versions)}
        return [logits[v][len(prompt) + i - 1, token].item() for i, (token, v) in enumerate(zip(tokens, versions))]
    cache = None
    for i, (token, version) in enumerate(zip(tokens, versions)):
        inputs = torch.tensor([prompt if i == 0 else [tokens[i - 1]]])
        step = models[version](inputs, past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        out.append(step.logits[0, -1].log_softmax(-1)[token].item())
    return out


def check_samples(samples: list[dict], kv_cache: str) -> None:
    models = [load(path) for path in MODELS]
    spanning = [s for s in samples if s["versions"][0] == 0 and s["versions"][-1] == 1]
    assert spanning, [s["versions"] for s in samples]  # a sequence with tokens of both versions
    for sample in samples:
        versions = sample["versions"]
        assert len(versions) == len(sample["tokens"]) and versions == sorted(versions), versions
        expected = reference_logprobs(models, sample["prompt"], sample["tokens"], versions, kv_cache)
        assert max(abs(a - b) for a, b in zip(sample["logprobs"], expected)) < 1e-5, (versions, sample["logprobs"])
    if kv_cache == "keep":  # the old keys and values matter: the fresh forward of the new weights differs
        recomputed = [
            reference_logprobs(models, s["prompt"], s["tokens"], s["versions"], "recompute") for s in spanning
        ]
        differences = [abs(a - b) for s, r in zip(spanning, recomputed) for a, b in zip(s["logprobs"], r)]
        assert max(differences) > 1e-3


def test_hf_engine_loads_new_weights_between_decoding_steps():
    from reinforge.generation.hf import HFGenerationBackend

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(MODELS[0])))
    engine = InFlightEngine(HFGenerationBackend(load(MODELS[0]), tokenizer, max_batch_size=64))
    try:
        update = lambda weights, version: engine.update_weights(weights.items(), version=version)  # noqa: E731
        samples = generate_with_an_update(engine, update, update_after_steps=4)
        assert engine.version == 1 and engine.metrics()["generation/weight_updates"] == 1
    finally:
        engine.shutdown()
    check_samples(samples, "keep")


def vllm_run(out_path) -> None:
    from reinforge.cluster.weight_sync import at_once
    from reinforge.generation.vllm_async import AsyncVLLMEngine
    from reinforge.generation.weight_transfer import Sender

    kwargs = dict(model_path=str(MODELS[0]), dtype="float32", seed=0, max_model_len=256, block_size=32)
    engine = AsyncVLLMEngine(kwargs)  # vLLM's AsyncLLM, its engine core in a process of its own
    sender = Sender()  # a training rank's, on this process's thread: the refit's wire
    port = sender.host(1 + engine.transfer_ranks(), timeout_s=120)
    info = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, timeout_s=120)
    at_once(lambda: engine.init_weight_transfer(info), sender.join)

    def update(weights: dict, version: int) -> None:  # the engine receives while the sender sends
        send = lambda: sender.send([list(weights.items())], engine.refit_layout(), bucket_bytes=1 << 20)  # noqa: E731
        at_once(lambda: engine.receive_weights(version), send)

    out = {}
    try:
        for kv_cache in ("keep", "recompute"):
            update(load(MODELS[0]).state_dict(), 0)
            engine.kv_cache = kv_cache
            out[kv_cache] = generate_with_an_update(engine, update, update_after_steps=4)
            assert engine.version == 1 and engine.metrics()["generation/weight_updates"] == 2
    finally:
        engine.shutdown()
    out_path.write_text(json.dumps(out))


@pytest.fixture(scope="module")
def vllm_samples(tmp_path_factory):
    return run_in_fresh_process(vllm_run, out=tmp_path_factory.mktemp("in_flight") / "samples.json")


@pytest.mark.parametrize("kv_cache", ["keep", "recompute"])
def test_vllm_engine_updates_weights_with_requests_in_flight(vllm_samples, kv_cache):
    check_samples(vllm_samples[kv_cache], kv_cache)


def test_the_hf_engine_cannot_recompute_the_cache():
    from reinforge.errors import ConfigError

    with pytest.raises(ConfigError, match="in_flight_kv_cache=recompute needs generation.backend=vllm"):
        InFlightEngine(object(), kv_cache="recompute")
