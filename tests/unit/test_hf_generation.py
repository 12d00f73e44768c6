"""The Hugging Face generation backend on the demo model: stops, truncation, logprobs, seeding, refit."""

import pytest
import torch

from reinforge.data.batch import collate
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.single_turn import generate_trajectories
from reinforge.training.micro_batching import token_logprobs

MODEL = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))


@pytest.fixture(scope="module")
def setup():
    tokenizer = load_tokenizer(MODEL)
    prompts = [
        render_prompt(r, tokenizer, "prompt", None, True)
        for r in read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:4]
    ]
    return HFGenerationBackend(load_model(MODEL), tokenizer, max_batch_size=6), tokenizer, prompts


def test_completions_stop_at_eos_or_stop_string_and_record_truncation(setup):
    engine, tokenizer, prompts = setup
    done = engine.generate([prompts[0].token_ids], SamplingParams(max_new_tokens=60, temperature=0.0)).completions[0][0]
    assert done.finish_reason == "stop" and done.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in done.token_ids[:-1]
    cut = engine.generate(
        [prompts[0].token_ids], SamplingParams(max_new_tokens=60, temperature=0.0, stop_strings=("=",))
    ).completions[0][0]
    assert cut.finish_reason == "stop" and tokenizer.decode(cut.token_ids).endswith("=")
    short = engine.generate([prompts[0].token_ids], SamplingParams(max_new_tokens=3, temperature=0.0)).completions[0][0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_samples_are_grouped_by_prompt_seeded_and_chunked(setup):
    engine, _, prompts = setup
    ids = [p.token_ids for p in prompts]  # 4 prompts x 4 samples = 16 sequences, in chunks of 6
    first = engine.generate(ids, SamplingParams(max_new_tokens=40, num_samples=4, seed=3))
    again = engine.generate(ids, SamplingParams(max_new_tokens=40, num_samples=4, seed=3))
    assert [len(group) for group in first.completions] == [4, 4, 4, 4]
    assert all(c.prompt_index == i for i, group in enumerate(first.completions) for c in group)
    assert [[c.token_ids for c in g] for g in first.completions] == [
        [c.token_ids for c in g] for g in again.completions
    ]


def test_reported_logprobs_are_those_of_the_tempered_sampling_distribution(setup):
    engine, tokenizer, prompts = setup
    params = SamplingParams(max_new_tokens=40, temperature=0.7, num_samples=2, seed=1)
    trajectories = generate_trajectories(prompts, engine, params, tokenizer)
    batch = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    with torch.no_grad():
        logits = engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    recomputed = token_logprobs(logits, batch.input_ids, temperature=0.7) * batch.loss_mask
    torch.testing.assert_close(batch.gen_logprobs, recomputed, atol=1e-4, rtol=0)


def test_update_weights_replaces_the_engine_weights_in_place(setup):
    engine, _, prompts = setup
    other = load_model(MODEL)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(0.5)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.update_weights(other.state_dict().items())
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in other.state_dict().items())
    engine.update_weights(original.items())
