"""Multi-turn rollouts on the real demo model (HF engine, torch trainer) with real environments."""

import pytest
import torch

from reinforge.data.batch import collate
from reinforge.data.prompts import render_prompt
from reinforge.envs.base import EnvResponse
from reinforge.envs.format_env import FormatEnv, FormatEnvConfig
from reinforge.envs.math_env import MathEnv
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.rollout import RolloutOptions, observation_token_ids, rollout
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
CHECK_AGAIN = "Check your answer and reply again."


class AskAgainEnv:
    """A real two-turn environment: the first answer is met with a request to check it; the second
    is scored by the math verifier."""

    def __init__(self):
        self.math = MathEnv()

    def step(self, requests):
        first = [len([m for m in r.messages if m["role"] == "assistant"]) == 1 for r in requests]
        final = self.math.step([r for r, f in zip(requests, first) if not f])
        scored = iter(final)
        return [
            EnvResponse(reward=0.0, done=False, observation=[{"role": "user", "content": CHECK_AGAIN}])
            if f
            else next(scored)
            for f in first
        ]

    def metrics(self):
        return self.math.metrics()

    def close(self):
        self.math.close()


@pytest.fixture(scope="module")
def demo():
    tokenizer = load_tokenizer(DEMO)
    return tokenizer, HFGenerationBackend(load_model(DEMO), tokenizer, max_batch_size=64)


def prompts_for(tokenizer, records, system_prompt=None):
    return [render_prompt(r, tokenizer, "prompt", system_prompt, use_chat_template=True) for r in records]


RECORDS = [
    {
        "prompt": "Finn has 90 stickers. He loses 12. How many stickers does he have now?",
        "answer": "78",
        "task": "ask_again",
    },
    {
        "prompt": "A jar holds 86 pencils. Dev removes 38. How many pencils are in the jar now?",
        "answer": "48",
        "task": "ask_again",
    },
]


def test_observation_tokens_close_the_turn_frame_the_message_and_open_the_next_turn(demo):
    tokenizer, _ = demo
    observation = [{"role": "tool", "content": "68"}]
    ids = observation_token_ids(tokenizer, observation, ended_with_eos=False, max_tokens=256)
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>tool\n68<|im_end|>\n<|im_start|>assistant\n"
    ids = observation_token_ids(tokenizer, observation, ended_with_eos=True, max_tokens=256)
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n68<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_observation_is_cut_but_keeps_its_framing(demo):
    tokenizer, _ = demo
    ids = observation_token_ids(tokenizer, [{"role": "tool", "content": "7" * 500}], ended_with_eos=True, max_tokens=40)
    text = tokenizer.decode(ids)
    assert (
        len(ids) <= 40
        and text.startswith("\n<|im_start|>tool\n7")
        and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    )


def test_environment_tokens_are_never_trained_on_and_logprobs_stay_aligned(demo):
    tokenizer, engine = demo
    prompts = prompts_for(tokenizer, RECORDS)
    envs = {"ask_again": AskAgainEnv()}
    params = SamplingParams(max_new_tokens=40, temperature=1.0, num_samples=4, seed=3)
    trajectories = rollout(prompts, engine, params, tokenizer, envs, RolloutOptions(default_task="math", max_turns=2))
    assert len(trajectories) == 8 and all(t.num_turns == 2 for t in trajectories)
    expected_observation = tokenizer.decode(
        observation_token_ids(tokenizer, [{"role": "user", "content": CHECK_AGAIN}], True, 256)
    )
    for trajectory in trajectories:
        mask = trajectory.response_mask
        start = mask.index(0)
        end = start + mask[start:].index(1)
        assert mask[:start] == [1] * start and 0 not in mask[end:]  # policy, environment, policy
        assert tokenizer.decode(trajectory.response_ids[start:end]) == expected_observation
        assert all(lp == 0.0 for lp in trajectory.gen_logprobs[start:end])
        assert trajectory.reward in (0.0, 1.0)
    batch = collate(trajectories, [1.0] * len(trajectories), tokenizer.pad_token_id)
    observation_tokens = sum(len(t.response_ids) - sum(t.response_mask) for t in trajectories)
    assert batch.loss_mask.sum() == sum(sum(t.response_mask) for t in trajectories) and observation_tokens > 0
    # the trainer, reading the whole multi-turn sequence, gives the engine's logprobs to each policy token
    trainer = Backend(
        DEMO,
        TrainingConfig(micro_batch_size=8, global_batch_size=8),
        OptimizerConfig(),
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(1.0),
        load_reference=False,
    )
    old = trainer.logprobs(batch)
    error = torch.exp((old - batch.gen_logprobs)[batch.loss_mask > 0].abs()).mean().item()
    assert error < 1.001, error
    envs["ask_again"].close()


def test_extra_rewards_add_weighted_components_to_the_task_reward(demo):
    tokenizer, engine = demo
    records = [dict(r, task="math") for r in RECORDS]
    prompts = prompts_for(tokenizer, records, system_prompt="detailed thinking off")
    envs = {"math": MathEnv(), "format": FormatEnv(FormatEnvConfig())}
    params = SamplingParams(max_new_tokens=40, temperature=1.0, num_samples=4, seed=5)
    options = RolloutOptions(default_task="math", extra_rewards={"format": 0.5})
    trajectories = rollout(prompts, engine, params, tokenizer, envs, options)
    plain = rollout(prompts, engine, params, tokenizer, {"math": envs["math"]}, RolloutOptions(default_task="math"))
    for with_format, alone in zip(trajectories, plain):  # same seed: same samples
        assert with_format.response_ids == alone.response_ids
        assert with_format.reward == alone.reward + 0.5 * with_format.components["format"]
        assert with_format.components["task_reward"] == alone.reward  # the task's own, kept apart
    assert any(t.components["format"] == 1.0 for t in trajectories)  # "off": no think tags is compliant
    envs["math"].close()
