"""The curriculum (reinforge/data/curriculum.py, reinforge/loops/curriculum_prefilter.py): the progressive
sampler against hand-computed batches, its exact resume, and the pass-rate pre-filter on the real demo model with
the real math verifier."""

import json
import math

import pytest
import torch

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.curriculum import ProgressiveSampler, gaussian_targets, record_pass_rates
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import Prompt, PromptSampler, render_prompt
from reinforge.envs.registry import EnvConfig, build_envs
from reinforge.errors import ConfigError, DataError
from reinforge.generation.hf import HFGenerationBackend
from reinforge.loops.curriculum_prefilter import build_prompt_sampler, prefilter_setup
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.rollout import rollout

CONFIG = PROJECT_ROOT / "configs" / "grpo_curriculum_demo.yaml"
SMALL = ["rollout.num_prompts_per_step=4", "training.global_batch_size=32", "training.micro_batch_size=32"]


def config_with(*overrides: str):
    return load_config(CONFIG, [*SMALL, *overrides])


def fake_prompts(pass_rates: list[float]) -> list[Prompt]:
    """Prompts that only carry an id and a pass rate (the sampler never looks at the tokens)."""
    return [
        Prompt(record={"id": i, "pass_rate": rate}, messages=[], token_ids=[i]) for i, rate in enumerate(pass_rates)
    ]


def sampler_for(pass_rates, batch_size, **kwargs) -> ProgressiveSampler:
    settings = dict(seed=0, num_steps=5, start_pass_rate=1.0, end_pass_rate=0.0, sigma=0.25) | kwargs
    return ProgressiveSampler(fake_prompts(pass_rates), pass_rates, batch_size, **settings)


def test_gaussian_targets_are_the_rounded_normalised_gaussian_weights():
    """Bins at 0, 0.5, 1 with sigma 0.25 (2 sigma^2 = 0.125).

    Centre 1, 4 slots: weights exp(-1/0.125) = 0.000335, exp(-0.25/0.125) = 0.1353, 1; shares 0.0003, 0.1192,
    0.8805; quotas 0.0012, 0.4767, 3.5221 -> floors 0, 0, 3 and the one slot left to the largest remainder
    (0.5221, bin 1.0): [0, 0, 4].
    Centre 0.5, 8 slots: weights 0.1353, 1, 0.1353; quotas 0.852, 6.296, 0.852 -> floors 0, 6, 0; two slots left
    go to the equal remainders 0.852 of bins 0 and 1.0: [1, 6, 1].
    """
    assert gaussian_targets([0.0, 0.5, 1.0], centre=1.0, sigma=0.25, num_slots=4) == [0, 0, 4]
    assert gaussian_targets([0.0, 0.5, 1.0], centre=0.5, sigma=0.25, num_slots=8) == [1, 6, 1]
    assert gaussian_targets([0.0, 0.5, 1.0], centre=0.0, sigma=0.001, num_slots=3) == [3, 0, 0]  # far bins underflow


def test_a_bin_short_of_its_target_is_topped_up_from_the_largest_remaining_pool():
    """7 prompts at 0, 5 at 0.5, 2 at 1. The first batch (centre 1) targets [0, 0, 4]; bin 1.0 has only 2, and the
    shortfall of 2 comes from the largest pool, bin 0 (7 left), not from bin 0.5 (5 left)."""
    sampler = sampler_for([0.0] * 7 + [0.5] * 5 + [1.0] * 2, batch_size=4)
    batch = sampler.next_batch()
    assert sorted(p.record["pass_rate"] for p in batch) == [0.0, 0.0, 1.0, 1.0]
    assert sampler.last_batch_metrics()["curriculum/shortfall_fraction"] == 0.5
    assert sampler.state_dict()["taken"] == [2, 0, 2]


def test_equal_width_bins_sit_at_their_centres_and_empty_bins_are_left_out():
    """num_bins=4: 0.1 and 0.2 fall in [0, 0.25) (centre 0.125), 0.6 in [0.5, 0.75) (0.625), 0.9 and 1.0 in
    [0.75, 1] (0.875); [0.25, 0.5) holds none and takes no share."""
    sampler = sampler_for([0.1, 0.2, 0.6, 0.9, 1.0], batch_size=2, num_bins=4)
    assert sampler.bin_values == [0.125, 0.625, 0.875]
    assert sampler.bins == [[0, 1], [2], [3, 4]]


def test_no_prompt_repeats_within_an_epoch_and_every_prompt_comes_once_per_epoch():
    """14 prompts, batches of 7: batches 1-2 are epoch 0 and batches 3-4 epoch 1, each a permutation of all 14."""
    rates = [0.0] * 5 + [0.25] * 4 + [0.5] * 3 + [0.75] * 2
    sampler = sampler_for(rates, batch_size=7)
    batches = [[p.record["id"] for p in sampler.next_batch()] for _ in range(4)]
    assert sorted(batches[0] + batches[1]) == list(range(14))
    assert sorted(batches[2] + batches[3]) == list(range(14))
    assert sampler.last_batch_metrics()["curriculum/epoch"] == 1


def test_the_centre_moves_linearly_from_start_to_end_and_the_batches_follow_it():
    """num_steps 5, start 0.8, end 0: centres 0.8, 0.6, 0.4, 0.2, 0 and 0 from then on. With 40 prompts in each of
    the bins 0, 0.2, ..., 0.8 and sigma 0.05, almost all of a batch of 8 sits in the bin at the centre."""
    rates = [b / 5 for b in range(5) for _ in range(40)]
    sampler = sampler_for(rates, batch_size=8, start_pass_rate=0.8, sigma=0.05)
    metrics = []
    for _ in range(6):
        sampler.next_batch()
        metrics.append(sampler.last_batch_metrics())
    assert [m["curriculum/target_pass_rate"] for m in metrics] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0])
    assert [m["curriculum/batch_pass_rate_mean"] for m in metrics] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0])


def test_a_sampler_restored_from_its_json_state_continues_exactly_as_an_uninterrupted_one():
    """10 batches in one go == 4 batches, state through JSON into a new sampler, 6 more (3 epochs of 30 prompts)."""
    rates = [0.0] * 9 + [0.125] * 7 + [0.5] * 8 + [0.625] * 6

    def ids(sampler, count):
        return [[p.record["id"] for p in sampler.next_batch()] for _ in range(count)]

    uninterrupted = ids(sampler_for(rates, batch_size=8, seed=3, num_steps=10), 10)
    first = sampler_for(rates, batch_size=8, seed=3, num_steps=10)
    before = ids(first, 4)
    resumed = sampler_for(rates, batch_size=8, seed=3, num_steps=10)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert before + ids(resumed, 6) == uninterrupted
    assert resumed.last_batch_metrics()["curriculum/epoch"] == 2


def test_records_with_pass_rates_build_the_progressive_sampler_without_sampling(tmp_path):
    config = config_with(
        "rollout.num_prompts_per_step=2", "training.global_batch_size=16", "training.micro_batch_size=16"
    )
    prompts = fake_prompts([0.0, 0.25, 0.75, 1.0, 0.5])
    sampler, metrics = build_prompt_sampler(config, prompts, None, None, {}, tmp_path)
    assert isinstance(sampler, ProgressiveSampler)
    assert [p.record["id"] for p in sampler.prompts] == [0, 1, 4]  # 0.75 and 1.0 are at or above the threshold
    assert metrics == {
        "curriculum/num_prompts_kept": 3,
        "curriculum/prefilter_dropped_fraction": 0.4,
        "curriculum/kept_pass_rate_mean": 0.25,
    }
    assert not (tmp_path / "curriculum").exists()


def test_missing_pass_rates_are_one_line_errors_and_the_curriculum_off_is_a_plain_sampler(tmp_path):
    prompts = [Prompt(record={"id": i}, messages=[], token_ids=[i]) for i in range(3)]
    progressive_only = config_with("curriculum.prefilter=false")
    with pytest.raises(DataError, match="needs pass rates: set curriculum.prefilter=true"):
        build_prompt_sampler(progressive_only, prompts, None, None, {}, tmp_path)
    with pytest.raises(DataError, match="training record 1 has pass_rate=None"):
        record_pass_rates([Prompt(record={"pass_rate": r}, messages=[], token_ids=[]) for r in (0.5, None)])
    off = config_with("curriculum.prefilter=false", "curriculum.sampler=uniform")
    sampler, metrics = build_prompt_sampler(off, prompts, None, None, {}, tmp_path)
    assert type(sampler) is PromptSampler and metrics == {}
    with pytest.raises(ConfigError, match="curriculum.prefilter_threshold must be in"):
        config_with("curriculum.prefilter_threshold=0")


@pytest.fixture(scope="module")
def demo():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine two threads per process wait on each other
    model = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
    tokenizer = load_tokenizer(model)
    envs = build_envs(EnvConfig(), {"math"})
    yield tokenizer, HFGenerationBackend(load_model(model), tokenizer, max_batch_size=256), envs
    envs["math"].close()
    torch.set_num_threads(threads)


NUM_PROMPTS = 8


def test_the_prefilter_on_the_demo_model_drops_easy_prompts_and_is_read_back_not_resampled(demo, tmp_path):
    tokenizer, engine, envs = demo
    config = config_with()
    records = read_jsonl(PROJECT_ROOT / "data" / "demo" / "train.jsonl")[:NUM_PROMPTS]
    prompts = [render_prompt(r, tokenizer, "prompt", None, use_chat_template=True) for r in records]
    sampler, metrics = build_prompt_sampler(config, prompts, engine, tokenizer, envs, tmp_path)

    rows = [json.loads(line) for line in (tmp_path / "curriculum" / "pass_rates.jsonl").read_text().splitlines()]
    rates = [row["pass_rate"] for row in rows]
    assert [row["prompt"] for row in rows] == [r["prompt"] for r in records]
    assert all(math.isclose(rate * 8, round(rate * 8)) for rate in rates)  # multiples of 1/k, k = 8
    # with 0/1 math rewards the pass rate is the mean reward of the 8 samples: the same rollout, scored again
    params, options = prefilter_setup(config)
    trajectories = rollout(prompts, engine, params, tokenizer, envs, options)
    assert rates == [sum(t.reward for t in trajectories[8 * i : 8 * i + 8]) / 8 for i in range(NUM_PROMPTS)]
    kept = [p for p, rate in zip(prompts, rates) if rate < 0.75]
    assert 0 < len(kept) < NUM_PROMPTS, rates  # the demo model solves some of these prompts and not others
    assert sampler.prompts == kept and sampler.pass_rates == [rate for rate in rates if rate < 0.75]
    assert metrics["curriculum/num_prompts_kept"] == len(kept)
    assert metrics["curriculum/prefilter_dropped_fraction"] == 1 - len(kept) / NUM_PROMPTS

    again, again_metrics = build_prompt_sampler(
        config, prompts, None, tokenizer, envs, tmp_path
    )  # no engine: read back
    assert again.prompts == kept and again_metrics == metrics
    other = config_with("curriculum.prefilter_samples=4")
    with pytest.raises(AssertionError, match="needs the engine"):  # other settings: the stored rates are not reused
        build_prompt_sampler(other, prompts, None, tokenizer, envs, tmp_path)
