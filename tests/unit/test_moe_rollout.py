"""Router replay, the engine's side: the HF engine records the experts it sent every token to (generation/routes.py),
the rollouts carry them to the trajectories and the endpoint keeps them with each call, on a tiny random Qwen3-MoE
(2 MoE layers, 4 experts, top-2)."""

from dataclasses import replace

import numpy as np
import openai
import pytest
import torch
from conftest import build_tiny_moe

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.data.batch import collate
from reinforge.data.prompts import Prompt, render_prompt
from reinforge.envs.base import EnvResponse
from reinforge.errors import ConfigError, ReinforgeError
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.generation.routes import RouteRecorder
from reinforge.loops.run_checks import check_router_replay
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.agent import join_calls
from reinforge.rollout.rollout import RolloutOptions, rollout
from reinforge.rollout.single_turn import generate_trajectories
from reinforge.serving.app import build_app
from reinforge.serving.config import ServingConfig
from reinforge.serving.server import PolicyServer

DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))  # its tokenizer: pad 0, eos 2
PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41, 17, 8], [30, 31]]  # left-padded to 7 columns in one chunk
STOPS = (2, 11, 23, 35, 47, 59)  # frequent stops (a tenth of the tiny vocabulary): rows end at different lengths
ROUTED = SamplingParams(max_new_tokens=10, num_samples=2, seed=4, stop_token_ids=STOPS, record_routes=True)


@pytest.fixture(scope="module")
def engine(tiny_moe_model_dir):
    model = load_model(ModelConfig(name_or_path=str(tiny_moe_model_dir)))
    return HFGenerationBackend(model, load_tokenizer(DEMO), max_batch_size=8)


def forward_routes(model, token_ids: list[int]) -> np.ndarray:
    """The routes the model's own forward over `token_ids` (one unpadded row, no cache) computes: [T, L, K]."""
    by_layer = []
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, output: by_layer.append(output[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    for handle in handles:
        handle.remove()
    return torch.stack(by_layer, dim=1).numpy()


def test_recorded_routes_are_those_the_models_forward_computes_for_every_token_but_the_last(engine):
    """Each completion of P prompt and N generated tokens (left-padded rows of 3, 7 and 2 prompt tokens, ending
    at different lengths) has P + N - 1 routes, [tokens, 2 layers, top-2] uint8: the prompt's and every generated
    token's but the last (vLLM's convention), each the experts a full forward over prompt + completion chooses."""
    result = engine.generate(PROMPTS, ROUTED)
    lengths = {len(c.token_ids) for group in result.completions for c in group}
    assert len(lengths) > 1, "the test needs rows that end at different lengths"
    for prompt, group in zip(PROMPTS, result.completions):
        for completion in group:
            routes = completion.routed_experts
            assert routes.dtype == np.uint8 and routes.shape == (len(prompt) + len(completion.token_ids) - 1, 2, 2)
            expected = forward_routes(engine.model, prompt + completion.token_ids)[:-1]
            np.testing.assert_array_equal(routes, expected)


def test_recording_routes_changes_no_token_nor_logprob(engine):
    plain = replace(ROUTED, record_routes=False)
    without, with_routes = engine.generate(PROMPTS, plain), engine.generate(PROMPTS, ROUTED)
    for group, routed_group in zip(without.completions, with_routes.completions):
        for completion, routed in zip(group, routed_group):
            assert completion.routed_experts is None
            assert completion.token_ids == routed.token_ids and completion.logprobs == routed.logprobs


def test_single_turn_trajectories_carry_their_routes_and_collate_puts_them_at_their_columns(engine):
    prompts = [Prompt(token_ids=ids, messages=[], record={}) for ids in PROMPTS]
    trajectories = generate_trajectories(prompts, engine, ROUTED, engine.tokenizer)
    batch = collate(trajectories, [0.0] * len(trajectories), pad_token_id=0)
    assert batch.routed_experts.shape == (6, batch.input_ids.shape[1], 2, 2)
    for row, trajectory in enumerate(trajectories):
        tokens = trajectory.prompt_ids + trajectory.response_ids
        expected = forward_routes(engine.model, tokens)[:-1]
        assert torch.equal(batch.routed_experts[row, : len(tokens) - 1], torch.from_numpy(expected).long())
        assert (batch.routed_experts[row, len(tokens) - 1 :] == -1).all()  # the last token, then padding


def test_routes_asked_of_a_dense_model_are_an_error(tiny_model_dir):
    dense = load_model(ModelConfig(name_or_path=str(tiny_model_dir)))
    with pytest.raises(ReinforgeError, match="Qwen2ForCausalLM, which has no mixture-of-experts router"):
        RouteRecorder(dense)


def test_router_replay_on_a_model_without_experts_is_a_config_error(tiny_model_dir, tiny_moe_model_dir):
    def config(path) -> RLRunConfig:
        return RLRunConfig(model={"name_or_path": str(path), "moe": {"router_replay": "rollout"}})

    check_router_replay(config(tiny_moe_model_dir))  # 4 experts: replay is possible
    with pytest.raises(ConfigError, match=f"name_or_path={tiny_model_dir} has no experts.*router_replay=off"):
        check_router_replay(config(tiny_model_dir))


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    """The tiny MoE with the demo tokenizer's vocabulary (449 tokens, eos 2) and chat template."""
    path = build_tiny_moe(tmp_path_factory.mktemp("tiny_moe_449"), vocab_size=449, eos_token_id=2)
    tokenizer = load_tokenizer(DEMO)
    return HFGenerationBackend(load_model(ModelConfig(name_or_path=str(path))), tokenizer, max_batch_size=8)


class AskAgainEnv:
    """Two turns: the first answer gets "Again." back; the second ends the episode."""

    def step(self, requests):
        first = [sum(m["role"] == "assistant" for m in r.messages) == 1 for r in requests]
        return [EnvResponse(0.0, done=not f, observation=[{"role": "user", "content": "Again."}]) for f in first]


def test_a_multi_turn_trajectory_gets_its_last_calls_routes_which_cover_every_token_but_the_last(chat_engine):
    prompts = [render_prompt({"prompt": "Ann has 3 apples."}, chat_engine.tokenizer, "prompt", None, True)]
    stops = tuple(range(2, 449, 3))  # a third of the vocabulary: turns that stop rather than hit the length limit
    params = SamplingParams(max_new_tokens=8, num_samples=2, seed=1, stop_token_ids=stops, record_routes=True)
    options = RolloutOptions(default_task="again", max_turns=2)
    trajectories = rollout(prompts, chat_engine, params, chat_engine.tokenizer, {"again": AskAgainEnv()}, options)
    assert [t.num_turns for t in trajectories] == [2, 2]
    for trajectory in trajectories:
        tokens = trajectory.prompt_ids + trajectory.response_ids  # turn, observation, turn
        np.testing.assert_array_equal(trajectory.routed_experts, forward_routes(chat_engine.model, tokens)[:-1])


def test_the_endpoint_keeps_each_calls_routes_and_an_episode_gets_its_last_calls(chat_engine):
    """Two calls of one episode through the real endpoint and the openai client, the second continuing the first
    (its assistant message sent back with its token ids): each recorded call has the routes of its prompt and
    generation but the last token; the joined trajectory has the second call's, which ran all the first's tokens."""
    server = PolicyServer(
        chat_engine,
        chat_engine.tokenizer,
        ServingConfig(batch_wait_s=0),
        max_model_len=128,
        default_max_tokens=6,
        managed=True,
    )
    server.start(build_app(server))
    try:
        with server.rollout_session(SamplingParams(max_new_tokens=6, record_routes=True)) as session:
            with server.episode(session, keyed=True) as episode_id:
                policy = openai.OpenAI(base_url=server.episode_base_url(episode_id), api_key="none", max_retries=0)
                history = [{"role": "user", "content": "Ann has 3 apples."}]
                first = policy.chat.completions.create(model=server.model_name, messages=history)
                reply = first.choices[0].message.model_dump(exclude_none=True)
                history += [reply, {"role": "user", "content": "And 2 more?"}]
                policy.chat.completions.create(model=server.model_name, messages=history)
            calls = session.recorder.take_episode(episode_id)
    finally:
        server.stop()
    assert len(calls) == 2
    for call in calls:
        tokens = call.prompt_ids + call.generation_ids
        np.testing.assert_array_equal(call.routed_experts, forward_routes(chat_engine.model, tokens)[:-1])
    joined = join_calls(calls)
    assert joined.contiguous
    assert len(joined.routed_experts) == len(joined.prompt_ids) + len(joined.response_ids) - 1
    assert joined.routed_experts is calls[1].routed_experts
