"""The vLLM engine in a separate process (a real Ray actor): refit crosses the process boundary."""

import ray
import torch

import pytest

from reinforge.cluster.remote import RemoteGenerationBackend
from reinforge.config.schema import ModelConfig
from reinforge.data.jsonl import read_jsonl
from reinforge.errors import ConfigError
from reinforge.data.prompts import render_prompt
from reinforge.generation.base import SamplingParams
from reinforge.generation.vllm_backend import VLLMGenerationBackend
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

MODEL = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))


def test_engine_in_a_ray_actor_takes_new_weights_and_matches_the_trainer():
    tokenizer = load_tokenizer(MODEL)
    prompts = [render_prompt(r, tokenizer, "prompt", None, True) for r in read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:4]]
    model = load_model(MODEL).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = RemoteGenerationBackend(VLLMGenerationBackend, MODEL.name_or_path, dtype="float32", seed=0, max_model_len=256)
        engine.update_weights(model.state_dict().items())
        result = engine.generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens=30, temperature=0.0))
        for prompt, completions in zip(prompts, result.completions):
            expected = model.generate(torch.tensor([prompt.token_ids]), max_new_tokens=30, do_sample=False)[0, len(prompt.token_ids):]
            assert completions[0].token_ids == expected.tolist()[: len(completions[0].token_ids)]
        engine.shutdown()
        # a bad setting the actor's __init__ refuses reaches the caller as that ConfigError, not Ray's ActorDiedError
        refused = RemoteGenerationBackend(VLLMGenerationBackend, MODEL.name_or_path, dtype="float32", seed=0, max_model_len=256,
                                          block_size=48)
        with pytest.raises(ConfigError, match=r"^generation.vllm_block_size=48: vLLM's CPU attention needs a multiple of 32"):
            refused.generate([prompts[0].token_ids], SamplingParams(max_new_tokens=4))
        ray.kill(refused.actor)
    finally:
        ray.shutdown()
