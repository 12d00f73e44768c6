"""The endpoint's admission rules (`PolicyServer.admit`) on the demo model: what a run's endpoint refuses, the
settings each admitted request is generated with, and the HTTP status and OpenAI error body of each refusal."""

import threading
import time
from dataclasses import replace

import httpx
import pytest

from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.serving.app import build_app
from reinforge.serving.batcher import Batcher
from reinforge.serving.config import ServingConfig
from reinforge.serving.errors import EpisodeOver, InvalidRequest, NotInRollout
from reinforge.serving.protocol import ChatCompletionRequest, TokenizeRequest
from reinforge.serving.server import PolicyServer

DEMO = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
RUN = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=-1, seed=5)  # the run's settings
HELLO = [{"role": "user", "content": "Ann has 3 apples and finds 4 more. How many apples does she have?"}]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    tokenizer = load_tokenizer(DEMO)
    return HFGenerationBackend(load_model(DEMO), tokenizer, max_batch_size=8), tokenizer


@pytest.fixture
def make_server(engine_and_tokenizer):
    servers = []

    def make(managed: bool, max_model_len: int = 160) -> PolicyServer:
        engine, tokenizer = engine_and_tokenizer
        server = PolicyServer(
            engine,
            tokenizer,
            ServingConfig(batch_wait_s=0),
            max_model_len=max_model_len,
            default_max_tokens=6,
            managed=managed,
        )
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def ask(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=HELLO, **fields)


def test_a_run_endpoint_refuses_every_call_between_rollouts(make_server):
    server = make_server(managed=True)
    with pytest.raises(NotInRollout, match="serves agents only during the run's rollouts"):
        server.admit(ask(), None)


def test_a_call_under_an_episode_that_is_over_is_refused(make_server):
    server = make_server(managed=True)
    with server.rollout_session(RUN) as session:
        with server.episode(session, keyed=True) as episode_id:
            server.admit(ask(), episode_id).completions.result(TIMEOUT_S)
        with pytest.raises(EpisodeOver, match=f"episode {episode_id} is over"):
            server.admit(ask(), episode_id)
        with pytest.raises(EpisodeOver):
            server.admit(ask(), "ep-never-opened")


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"temperature": 0.5}, "temperature", "temperature=0.5 differs from the run's temperature=1.0"),
        ({"top_p": 0.5}, "top_p", "top_p=0.5 differs from the run's top_p=0.9"),
        ({"top_k": 5}, "top_k", "top_k=5 differs from the run's top_k=-1"),
        ({"n": 2}, "n", "n=2: during training each call samples one completion"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice='required' is not supported"),
    ],
)
def test_a_run_endpoint_refuses_sampling_other_than_the_runs_naming_the_field(make_server, fields, param, message):
    server = make_server(managed=True)
    with server.rollout_session(RUN):
        with pytest.raises(InvalidRequest, match=message) as refused:
            server.admit(ask(**fields), None)
    assert refused.value.param == param


def test_a_run_endpoint_generates_with_the_runs_settings_capped_at_its_max_tokens(make_server):
    """Within 1e-6 of the run's temperature is the run's; a seed is ignored (the run's, 5, stays); max_tokens=100
    is capped at the run's 8, max_tokens=3 is kept; the request's stop strings are used."""
    server = make_server(managed=True)
    with server.rollout_session(RUN) as session:
        with server.episode(session, keyed=True) as episode_id:
            capped = server.admit(ask(max_tokens=100, temperature=1.0 + 1e-7, seed=99, top_k=0), episode_id)
            short = server.admit(ask(max_completion_tokens=3, stop=["\n"]), episode_id)
            for admission in (capped, short):
                server.record(admission, admission.completions.result(TIMEOUT_S))
            recorded = session.recorder.take_episode(episode_id)
    assert capped.params == replace(RUN, max_new_tokens=8, num_samples=1)
    assert short.params == replace(RUN, max_new_tokens=3, num_samples=1, stop_strings=("\n",))
    assert [call.prompt_ids for call in recorded] == [capped.prompt_ids, short.prompt_ids]
    assert len(recorded[1].generation_ids) <= 3


def test_a_call_admitted_before_its_rollout_closes_is_answered_before_the_close_returns(make_server):
    server = make_server(managed=True)
    with server.rollout_session(RUN):
        admission = server.admit(ask(), None)
    assert admission.completions.done() and len(admission.completions.result()) == 1


def test_a_standalone_endpoint_generates_with_the_requests_own_settings(make_server):
    """No max_tokens: the server's default, 6; top_k 0 means none (-1); n=3 gives three completions."""
    server = make_server(managed=False)
    admission = server.admit(ask(temperature=0.3, top_p=0.8, top_k=0, n=3, seed=7), None)
    assert admission.params == SamplingParams(
        max_new_tokens=6, temperature=0.3, top_p=0.8, top_k=-1, num_samples=3, seed=7
    )
    assert admission.session is None and len(admission.completions.result(TIMEOUT_S)) == 3


def test_max_tokens_is_cut_to_the_room_the_context_leaves_and_a_full_context_is_refused(make_server):
    """With L prompt tokens, a context of L + 4 leaves room for 4 of the 6 asked; a context of L leaves none."""
    probe = make_server(managed=False)
    length = len(probe.tokenize(TokenizeRequest(messages=HELLO)))
    admission = make_server(managed=False, max_model_len=length + 4).admit(ask(max_tokens=6), None)
    assert admission.prompt_ids == probe.tokenize(TokenizeRequest(messages=HELLO))
    assert admission.params.max_new_tokens == 4
    with pytest.raises(InvalidRequest, match=f"maximum context length is {length} tokens, and the prompt has {length}"):
        make_server(managed=False, max_model_len=length).admit(ask(), None)


def test_the_counts_are_of_admissions_and_rejections_since_the_last_read(make_server):
    server = make_server(managed=True)
    with pytest.raises(NotInRollout):
        server.admit(ask(), None)
    server.count_rejected()
    with server.rollout_session(RUN):
        server.admit(ask(), None)
    first, second = server.metrics(), server.metrics()
    assert (first["requests"], first["rejected"], first["sequences"]) == (2, 1, 1)
    assert (second["requests"], second["rejected"], second["sequences"]) == (0, 0, 0)


def test_the_routes_answer_each_refusal_with_its_status_and_openai_error(make_server):
    server = make_server(managed=True)
    server.start(build_app(server))

    def post(path: str, **fields) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json={"messages": HELLO, **fields}, timeout=TIMEOUT_S)

    between = post("/v1/chat/completions")
    assert between.status_code == 503 and between.json()["error"]["type"] == "unavailable"
    with server.rollout_session(RUN) as session:
        with server.episode(session, keyed=True) as episode_id:
            pass
        over = post(f"/episodes/{episode_id}/v1/chat/completions")
        hot = post("/v1/chat/completions", temperature=0.5)
        answered = post(f"/episodes/{episode_id}/tokenize")
    assert over.status_code == 409 and over.json()["error"] == {
        "message": f"episode {episode_id} is over (it ended or timed out); its calls are no longer recorded",
        "type": "conflict",
        "param": None,
        "code": None,
    }
    assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"
    assert answered.status_code == 200 and answered.json()["count"] == len(answered.json()["tokens"])
    assert server.metrics()["rejected"] == 3


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field_and_the_vocabulary_size(make_server):
    """The demo model has 449 tokens: a spliced assistant message with id 449, or a required prefix with -1,
    is refused before it reaches the engine (which would fail with an index error, a 500)."""
    server = make_server(managed=False)
    server.start(build_app(server))
    reply = {"role": "assistant", "content": "7", "prompt_token_ids": [1, 2], "generation_token_ids": [5, 449]}
    history = [*HELLO, reply, {"role": "user", "content": "And 2 more?"}]
    spliced = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": history}, timeout=TIMEOUT_S)
    assert spliced.status_code == 400, spliced.text
    assert spliced.json()["error"]["param"] == "messages[1].generation_token_ids"
    assert "token id 449, outside the model's vocabulary of 449 tokens" in spliced.json()["error"]["message"]
    with pytest.raises(InvalidRequest, match="required_prefix_token_ids holds token id -1") as refused:
        server.tokenize(
            TokenizeRequest(messages=[*HELLO, {"role": "assistant", "content": "7"}], required_prefix_token_ids=[3, -1])
        )
    assert refused.value.param == "required_prefix_token_ids"


def test_a_seed_beyond_64_bits_is_a_400_naming_the_seed(make_server):
    server = make_server(managed=False)
    server.start(build_app(server))
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HELLO, "seed": 2**70}, timeout=TIMEOUT_S)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "seed", answer.text


def test_rollout_sessions_open_at_once_keep_their_own_settings_and_records(make_server):
    """In flight every prompt group opens a session of its own: an episode's calls take its session's settings and
    are recorded for it; a call without an episode (a Gym agent's) takes the oldest open session's and stays
    claimable until no session open when it was made is left; each closing session counts what it left."""
    server = make_server(managed=True)
    first_run, second_run = replace(RUN, max_new_tokens=3), replace(RUN, max_new_tokens=5, seed=6)

    def call(episode_id):
        admission = server.admit(ask(), episode_id)
        server.record(admission, admission.completions.result(TIMEOUT_S))
        return admission

    with server.rollout_session(first_run) as first:
        second_session = server.rollout_session(second_run)
        second = second_session.__enter__()
        with server.episode(first, keyed=True) as first_episode, server.episode(second, keyed=True) as second_episode:
            assert call(first_episode).params.max_new_tokens == 3
            assert call(second_episode).params.max_new_tokens == 5
            unkeyed = call(None)
        assert unkeyed.params.max_new_tokens == 3  # the oldest open session's settings
        assert first.recorder is second.recorder
    assert first.unclaimed == 1  # its episode's call, never taken; the call without one may be the second's
    assert len(second.recorder.take_episode(second_episode)) == 1
    generated = unkeyed.completions.result(TIMEOUT_S)[0].token_ids
    assert second.recorder.claim(unkeyed.prompt_ids, list(generated)) is not None
    leftover = call(None)
    second_session.__exit__(None, None, None)
    assert second.unclaimed == 1  # the last call, which nobody claimed
    assert second.recorder.claim(leftover.prompt_ids, list(leftover.completions.result(0)[0].token_ids)) is None
    with pytest.raises(NotInRollout):
        server.admit(ask(), None)


@pytest.mark.parametrize("max_concurrent_calls", [1, 2])
def test_an_engine_that_takes_concurrent_calls_gets_batches_at_once(engine_and_tokenizer, max_concurrent_calls):
    """serving/batcher.py: batches of different settings go to the engine one at a time, or, for an engine that
    takes concurrent calls (in flight), up to `max_concurrent_calls` at once."""
    engine, _ = engine_and_tokenizer
    entered, release = [], threading.Event()

    class GatedEngine:  # the demo engine, whose calls wait at a gate
        def generate(self, prompts, params):
            entered.append(params.max_new_tokens)
            release.wait(TIMEOUT_S)
            return engine.generate(prompts, params)

    batcher = Batcher(GatedEngine(), max_batch_size=8, batch_wait_s=0, request_timeout_s=TIMEOUT_S,
                      max_concurrent_calls=max_concurrent_calls)  # fmt: skip
    try:
        futures = [batcher.submit([5, 6, 7], replace(RUN, max_new_tokens=n)) for n in (2, 3)]
        time.sleep(1.0)
        assert len(entered) == max_concurrent_calls
        release.set()
        assert [len(future.result(TIMEOUT_S)) for future in futures] == [1, 1]
        assert sorted(entered) == [2, 3]
    finally:
        release.set()
        batcher.close()
