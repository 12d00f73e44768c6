"""The generation engine as the product runs it on Ray (cluster/generation_group.py, a real Ray actor):
refit crosses the process boundary, and a setting only the engine can check comes back as its own error."""

import time

import pytest
import ray
import torch

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.errors import ConfigError
from reinforge.generation.base import SamplingParams
from reinforge.loops.builders import engine_group
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

ENGINE = ["generation.backend=vllm", "generation.num_workers=1", "generation.vllm.max_model_len=256"]


def config(*overrides: str):
    return load_config(PROJECT_ROOT / "configs" / "grpo_demo.yaml", [*ENGINE, *overrides])


def test_an_engine_in_a_ray_actor_takes_new_weights_and_matches_the_trainer():
    run = config()
    tokenizer = load_tokenizer(run.model)
    prompts = [
        render_prompt(r, tokenizer, "prompt", None, True)
        for r in read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:4]
    ]
    model = load_model(run.model).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = engine_group(run)  # cluster.num_cpus_per_worker (1) CPU, no GPU
        engine.update_weights(model.state_dict().items())
        result = engine.generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens=30, temperature=0.0))
        for prompt, completions in zip(prompts, result.completions):
            expected = model.generate(torch.tensor([prompt.token_ids]), max_new_tokens=30, do_sample=False)[
                0, len(prompt.token_ids) :
            ]
            assert completions[0].token_ids == expected.tolist()[: len(completions[0].token_ids)]
        engine.shutdown()
        # a setting the engine's constructor refuses reaches the caller as that ConfigError (the worker's setup
        # call carries it), not as Ray's ActorDiedError, and the group's actors and placement group are released
        with pytest.raises(
            ConfigError, match=r"^generation.vllm.block_size=48: vLLM's CPU attention needs a multiple of 32"
        ):
            engine_group(config("generation.vllm.block_size=48"))
        deadline = time.monotonic() + 15  # Ray frees a removed placement group's resources asynchronously
        while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == 2.0
    finally:
        ray.shutdown()
