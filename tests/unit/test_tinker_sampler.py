"""The Tinker server's sampler (reinforge/tinker/sampler.py, engine_slot.py) on the demo model with the HF engine and
a real torch training backend: the logprobs it returns are the trainer's of the same tokens at the same temperature,
it serves a trainer's new weights (refit verified by digests) and the base again, and it honours stops and seeds."""

from dataclasses import dataclass

import pytest
import torch

from reinforge.data.batch import Trajectory, collate
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.generation.base import GenerationConfig
from reinforge.generation.weight_digest import RefitMismatch, report
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.tinker.engine_slot import BaseWeights, LiveWeights
from reinforge.tinker.errors import TinkerRequestError
from reinforge.tinker.sampler import SampleParams, Samplers
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from tests.unit.test_refit_verify import one_step as optimizer_step

DEMO = ModelConfig(name_or_path="models/demo")
BASE = "demo"


@dataclass
class Trainer:
    """What the sampler reads of a training client: its backend and the version of its weights (unhashable, as a
    dataclass with equality is)."""

    backend: Backend
    version: int = 0


def make_backend(model: ModelConfig = DEMO, temperature: float = 1.0) -> Backend:
    training = TrainingConfig(micro_batch_size=8, global_batch_size=8)
    return Backend(model, training, OptimizerConfig(lr=1e-2), SchedulerConfig(), 10, head=LogprobHead(temperature))


def prompts(n: int = 2) -> list[list[int]]:
    tokenizer = load_tokenizer(DEMO)
    rows = read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:n]
    return [render_prompt(row, tokenizer, "prompt", None, True).token_ids for row in rows]


def one_step(trainer: Trainer) -> None:
    """A real optimizer step (test_refit_verify's: every trained token's logprob pushed up), a new version."""
    optimizer_step(trainer.backend)
    trainer.version += 1


@pytest.fixture
def samplers(tmp_path):
    tokenizer = load_tokenizer(DEMO)
    made = Samplers({BASE: DEMO}, GenerationConfig(max_new_tokens=24), lambda name: tokenizer, tmp_path)
    yield made
    made.shutdown()


def trainer_logprobs(backend: Backend, prompt: list[int], samples) -> list[list[float]]:
    rows = [Trajectory(prompt, s.tokens, s.logprobs, False, 0.0, 0, "math") for s in samples]
    logprobs_BT = backend.logprobs(collate(rows, [0.0] * len(rows), pad_token_id=0))
    return [logprobs_BT[row, len(prompt) : len(prompt) + len(s.tokens)].tolist() for row, s in enumerate(samples)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_trainers_logprobs_of_the_same_tokens(samplers, temperature):
    trainer = Trainer(make_backend(temperature=temperature))
    one_step(trainer)  # not the base: the engine samples the trainer's weights
    prompt = prompts(1)[0]
    live = LiveWeights(BASE, trainer, trainer.version, None)
    (result,) = samplers.sample(live, [prompt], 6, SampleParams(max_tokens=16, temperature=temperature, seed=3))
    assert len(result.sequences) == 6 and sum(len(s.tokens) for s in result.sequences) > 12
    for sample, expected in zip(result.sequences, trainer_logprobs(trainer.backend, prompt, result.sequences)):
        assert sample.logprobs == pytest.approx(expected, abs=1e-4)


def engine_weights(samplers) -> dict[str, str]:
    return report("engine", samplers.slots[BASE].engine.model.state_dict().items()).digests


def keep_old_weights(engine, part: str, monkeypatch) -> None:
    """Fault injection: the engine's refit keeps its old weights whose names hold `part`, and says nothing."""
    real = engine.update_weights

    def update_weights(named):
        kept = [(n, t.clone()) for n, t in engine.model.state_dict().items() if part in n]
        real([(n, t) for n, t in named if part not in n] + kept)

    monkeypatch.setattr(engine, "update_weights", update_weights)


def test_the_engine_serves_a_trainers_new_weights_then_the_base_again_refitting_only_on_change(samplers, monkeypatch):
    trainer, params = Trainer(make_backend()), SampleParams(max_tokens=8, temperature=0.0)
    base = samplers.sample(BaseWeights(BASE), prompts(), 1, params)
    base_digests = engine_weights(samplers)
    one_step(trainer)
    trained = report("trainer", trainer.backend.named_weights()).digests
    samplers.sample(LiveWeights(BASE, trainer, trainer.version, None), prompts(), 1, params)
    assert engine_weights(samplers) == trained != base_digests
    refits = samplers.slots[BASE].refits
    samplers.sample(LiveWeights(BASE, trainer, None, None), prompts(), 1, params)  # inflight: the same version
    assert samplers.slots[BASE].refits == refits  # held already: no refit
    again = samplers.sample(BaseWeights(BASE), prompts(), 1, params)
    assert engine_weights(samplers) == base_digests
    assert [r.sequences[0].tokens for r in again] == [r.sequences[0].tokens for r in base]
    # a refit that silently keeps one old weight is caught by the digests
    one_step(trainer)
    keep_old_weights(samplers.slots[BASE].engine, "layers.1.mlp", monkeypatch)
    with pytest.raises(RefitMismatch, match="layers.1.mlp"):
        samplers.sample(LiveWeights(BASE, trainer, trainer.version, None), prompts(), 1, params)


def test_a_snapshot_is_served_while_held_and_a_replaced_one_is_a_one_line_error(samplers):
    trainer = Trainer(make_backend())
    snapshot = LiveWeights(BASE, trainer, trainer.version, None)
    params = SampleParams(max_tokens=8, seed=1)
    first = samplers.sample(snapshot, prompts(), 2, params)
    one_step(trainer)
    assert samplers.sample(snapshot, prompts(), 2, params)[0].sequences[0].tokens == first[0].sequences[0].tokens
    samplers.sample(BaseWeights(BASE), prompts(), 1, params)
    with pytest.raises(TinkerRequestError, match="since replaced"):
        samplers.sample(snapshot, prompts(), 1, params)


def test_lora_live_weights_are_served_merged_by_the_hf_engine(samplers):
    lora = DEMO.model_copy(update={"lora": LoraConfig(rank=4, alpha=8)})
    trainer = Trainer(make_backend(lora))
    one_step(trainer)
    prompt = prompts(1)[0]
    (result,) = samplers.sample(
        LiveWeights(BASE, trainer, trainer.version, 4), [prompt], 4, SampleParams(max_tokens=12, seed=0)
    )
    for sample, expected in zip(result.sequences, trainer_logprobs(trainer.backend, prompt, result.sequences)):
        assert sample.logprobs == pytest.approx(expected, abs=1e-4)


def test_stop_token_ids_stop_strings_and_no_stop_at_all(samplers):
    tokenizer = load_tokenizer(DEMO)
    free = samplers.sample(BaseWeights(BASE), prompts(1), 8, SampleParams(max_tokens=24, seed=5, stop=[]))[0]
    assert all(len(s.tokens) == 24 and s.stop_reason == "length" for s in free.sequences)
    stop_id = free.sequences[0].tokens[3]  # a token the model does sample here
    by_id = samplers.sample(BaseWeights(BASE), prompts(1), 8, SampleParams(max_tokens=24, seed=5, stop=[stop_id]))[0]
    assert any(s.stop_reason == "stop" for s in by_id.sequences)
    for s in by_id.sequences:
        ends = [i for i, t in enumerate(s.tokens) if t in (stop_id, tokenizer.eos_token_id)]
        assert ends == ([len(s.tokens) - 1] if s.stop_reason == "stop" else [])
    text = tokenizer.decode(free.sequences[1].tokens[2:4])
    by_string = samplers.sample(BaseWeights(BASE), prompts(1), 8, SampleParams(max_tokens=24, seed=5, stop=[text]))[0]
    assert any(s.stop_reason == "stop" for s in by_string.sequences)
    for s in by_string.sequences:
        if s.stop_reason == "stop" and s.tokens[-1] != tokenizer.eos_token_id:
            assert text in tokenizer.decode(s.tokens) and text not in tokenizer.decode(s.tokens[:-1])
        else:
            assert text not in tokenizer.decode(s.tokens)


def test_a_seed_repeats_its_samples_and_no_seed_draws_afresh(samplers):
    def tokens(seed):
        result = samplers.sample(BaseWeights(BASE), prompts(), 3, SampleParams(max_tokens=16, seed=seed))
        return [s.tokens for r in result for s in r.sequences]

    assert tokens(7) == tokens(7) != tokens(8)
    assert tokens(None) != tokens(None)


def test_prompt_logprobs_are_the_models_own_of_each_prompt_token(samplers):
    prompt = prompts(1)[0]
    params = SampleParams(max_tokens=1, temperature=0.5, prompt_logprobs=True, topk_prompt_logprobs=3)
    (result,) = samplers.sample(BaseWeights(BASE), [prompt], 1, params)
    model = load_model(DEMO)
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], -1)
    assert result.prompt_logprobs[0] is None and result.topk_prompt_logprobs[0] is None
    expected = logprobs_TV.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert result.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    for position, top in enumerate(result.topk_prompt_logprobs[1:]):
        assert [t for t, _ in top] == logprobs_TV[position].topk(3).indices.tolist()
    last = SampleParams(max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3)
    (result,) = samplers.sample(BaseWeights(BASE), [prompt], 1, last)
    assert result.prompt_logprobs[:-3] == [None] * (len(prompt) - 3) == result.topk_prompt_logprobs[:-3]
    assert result.prompt_logprobs[-3:] == pytest.approx(expected[-3:], abs=1e-5)


@pytest.mark.parametrize(
    "params, message",
    [
        (SampleParams(max_tokens=0), "max_tokens=0"),
        (SampleParams(temperature=-1.0), "temperature"),
        (SampleParams(top_p=0.0), "top_p"),
        (SampleParams(top_k=0), "top_k"),
        (SampleParams(max_tokens=5000), "context"),
        (SampleParams(stop=[1.5]), "stop"),
        (SampleParams(prompt_logprobs=True, prompt_logprobs_last_n=500), "prompt_logprobs_last_n=500"),
    ],
)
def test_bad_requests_are_one_line_errors(samplers, params, message):
    with pytest.raises(TinkerRequestError, match=message) as error:
        samplers.sample(BaseWeights(BASE), prompts(1), 1, params)
    assert "\n" not in str(error.value)


def test_an_unknown_base_model_or_token_is_a_one_line_error(samplers):
    with pytest.raises(TinkerRequestError, match="unknown base model 'Qwen/Qwen3-8B'; this server holds: demo"):
        samplers.sample(BaseWeights("Qwen/Qwen3-8B"), prompts(1), 1, SampleParams())
    with pytest.raises(TinkerRequestError, match="prompt token 449 is outside"):
        samplers.sample(BaseWeights(BASE), [[1, 449]], 1, SampleParams())
