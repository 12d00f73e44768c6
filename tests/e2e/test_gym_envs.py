"""NeMo Gym resources servers both ways, all real: Gym's own servers (started from the Gym virtualenv
with tests/e2e/_gym.py) scoring reinforge-driven conversations through GymResourcesEnv (reinforge's
environments served as Gym resources servers: test_gym_server.py).

The Gym servers' answers are computed from their verify code (nemo-gym 0.7.0):
- example_single_tool_call: reward 1.0 iff the output holds a function_call named get_weather (a
  final text answer is allowed); get_weather answers `{"city": C, "weather_description": "The
  weather in C is cold."}`.
- example_tool_call_multireward: three {0, 1} components, reward their sum: correctness (some call
  is get_weather with the row's expected arguments), schema_valid (the first call's arguments hold
  every required parameter), format (exactly one call and no assistant message item at all).
- example_session_state_mgmt: a counter per session cookie, seeded with the row's `initial_count`;
  reward 1.0 iff it equals `expected_count` at verify.
"""

import json
import socket
import time
from pathlib import Path

import pytest
from _gym import GymLaunchError, gym_python, gym_servers
from _gym_episodes import Episode, assistant, call, gym_env

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.prompts import render_prompt
from reinforge.envs.base import EnvRequest
from reinforge.envs.gym import GymResourcesEnv, GymServerError
from reinforge.envs.registry import build_env, check_tasks
from reinforge.errors import DataError
from reinforge.network import free_port

pytestmark = pytest.mark.xdist_group("gym")

ROOT = Path(__file__).resolve().parents[2]
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "strict": True,
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
WEATHER_ROW = {
    "responses_create_params": {
        "input": [{"role": "developer", "content": "You help."}, {"role": "user", "content": "what's it like in sf?"}],
        "tools": [WEATHER_TOOL],
    },
    "expected_call": {"name": "get_weather", "arguments": {"city": "San Francisco"}},
    "task": "weather",
}
COUNTER_TOOLS = [
    {
        "type": "function",
        "name": "increment_counter",
        "strict": True,
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"count": {"type": "integer"}},
            "required": ["count"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "get_counter_value",
        "strict": True,
        "description": "",
        "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
    },
]
GYM_CONFIG = {
    "weather": {"resources_servers": {"example_single_tool_call": {"entrypoint": "app.py", "domain": "agent"}}},
    "multireward": {
        "resources_servers": {"example_tool_call_multireward": {"entrypoint": "app.py", "domain": "agent"}}
    },
    "counter": {"resources_servers": {"example_session_state_mgmt": {"entrypoint": "app.py", "domain": "agent"}}},
}


SF_CALL = call("get_weather", {"city": "San Francisco"})


@pytest.fixture(scope="module")
def gym_urls(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gym_logs")
    began = time.monotonic()
    with gym_servers(GYM_CONFIG, log_dir) as urls:
        print(f"\nthree Gym resources servers up in {time.monotonic() - began:.1f} s")
        yield urls


def test_a_correct_call_gets_the_tools_output_then_reward_one(gym_urls):
    env = gym_env(gym_urls["weather"])
    episode = Episode(WEATHER_ROW, "e-correct")
    (response,) = env.step([episode.turn(f"Let me look.\n{SF_CALL}")])
    assert response.observation == [
        {
            "role": "tool",
            "content": '{"city":"San Francisco","weather_description":"The weather in San Francisco is cold."}',
        }
    ]
    episode.observe(response)
    (verdict,) = env.step([episode.turn("It is cold in San Francisco.")])
    assert (verdict.done, verdict.reward, verdict.components, verdict.mask_sample) == (True, 1.0, {}, False)
    assert env.metrics() == {
        "seed_calls": 1.0,
        "tool_calls": 1.0,
        "tool_errors": 0.0,
        "verify_calls": 1.0,
        "masked": 0.0,
    }
    assert env.metrics()["seed_calls"] == 0.0  # counters since the last call
    env.close()


def test_no_call_an_unlisted_tool_or_a_malformed_call_score_what_gym_says(gym_urls):
    env = gym_env(gym_urls["weather"])
    (no_call,) = env.step([Episode(WEATHER_ROW, "e-none").turn("It is probably foggy.")])
    assert (no_call.done, no_call.reward) == (True, 0.0)
    unlisted, malformed = Episode(WEATHER_ROW, "e-unlisted"), Episode(WEATHER_ROW, "e-malformed")
    responses = env.step(
        [
            unlisted.turn(call("get_forecast", {"city": "SF"})),
            malformed.turn('<tool_call>{"name": "get_weather",</tool_call>'),
        ]
    )
    assert responses[0].observation == [
        {"role": "tool", "content": "error: unknown tool 'get_forecast'; tools: get_weather"}
    ]
    assert responses[1].observation[0]["content"].startswith("error: the tool call is not valid JSON")
    unlisted.observe(responses[0])
    malformed.observe(responses[1])
    verdicts = env.step([unlisted.turn("Foggy."), malformed.turn("Foggy.")])
    assert [v.reward for v in verdicts] == [0.0, 0.0]  # neither output holds a get_weather call
    assert env.metrics() == {
        "seed_calls": 3.0,
        "tool_calls": 2.0,
        "tool_errors": 2.0,
        "verify_calls": 3.0,
        "masked": 0.0,
    }
    env.close()


def test_a_tools_http_error_is_its_output_as_in_gyms_simple_agent(gym_urls):
    env = gym_env(gym_urls["weather"])
    episode = Episode(WEATHER_ROW, "e-422")
    (response,) = env.step([episode.turn(call("get_weather", {"town": "SF"}))])
    detail = json.loads(response.observation[0]["content"])["detail"]
    assert detail[0]["loc"] == ["body", "city"] and detail[0]["type"] == "missing"
    episode.observe(response)
    (verdict,) = env.step([episode.turn("I could not tell.")])
    assert verdict.reward == 1.0  # this verifier only asks for a get_weather call
    assert env.metrics()["tool_errors"] == 1.0
    env.close()


@pytest.mark.parametrize(
    "turns, reward, components",
    [
        ([SF_CALL], 3.0, {"correctness": 1.0, "schema_valid": 1.0, "format": 1.0}),
        ([SF_CALL, "It is sunny."], 2.0, {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0}),
        ([f"Sure!\n{SF_CALL}"], 2.0, {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0}),
        ([call("get_weather", {"city": "Paris"})], 2.0, {"correctness": 0.0, "schema_valid": 1.0, "format": 1.0}),
        ([call("get_weather", {})], 1.0, {"correctness": 0.0, "schema_valid": 0.0, "format": 1.0}),
        (["Sunny, I guess."], 0.0, {"correctness": 0.0, "schema_valid": 0.0, "format": 0.0}),
    ],
)
def test_multireward_components_come_back_as_the_servers_reward_components(gym_urls, turns, reward, components):
    """A one-turn episode ends at its last turn (the call is not run); a two-turn one calls the tool first."""
    env = gym_env(gym_urls["multireward"])
    episode = Episode(WEATHER_ROW, f"e-multi-{len(turns)}-{reward}")
    for number, text in enumerate(turns, start=1):
        (response,) = env.step([episode.turn(text, last_turn=number == len(turns) == 1)])
        if number < len(turns):
            assert "is sunny" in response.observation[0]["content"]
            episode.observe(response)
    assert (response.done, response.reward, response.components) == (True, reward, components)
    env.close()


def test_each_episode_keeps_its_own_session_cookie_when_episodes_interleave(gym_urls):
    env = gym_env(gym_urls["counter"])
    row_a = {
        "responses_create_params": {"input": "add 1 then add 2 then get the count", "tools": COUNTER_TOOLS},
        "initial_count": 3,
        "expected_count": 6,
    }
    row_b = {
        "responses_create_params": {"input": "add 5", "tools": COUNTER_TOOLS},
        "initial_count": 10,
        "expected_count": 15,
    }
    a, b = Episode(row_a, "e-a"), Episode(row_b, "e-b")
    first = env.step([a.turn(call("increment_counter", {"count": 1})), b.turn(call("increment_counter", {"count": 5}))])
    assert [r.observation for r in first] == [[{"role": "tool", "content": '{"success":true}'}]] * 2
    a.observe(first[0])
    b.observe(first[1])
    second = env.step(
        [b.turn("Done."), a.turn(call("increment_counter", {"count": 2}) + call("get_counter_value", {}))]
    )
    assert (second[0].done, second[0].reward) == (True, 1.0)  # 10 + 5: B's session alone
    assert second[1].observation == [
        {"role": "tool", "content": '{"success":true}'},
        {"role": "tool", "content": '{"count":6}'},
    ]
    a.observe(second[1])
    (verdict,) = env.step([a.turn("The count is 6.")])
    assert verdict.reward == 1.0  # 3 + 1 + 2
    env.close()


def test_a_row_the_server_rejects_fails_at_once_with_its_answer(gym_urls):
    env = gym_env(gym_urls["counter"], max_retries=3, backoff_s=10.0)  # a retry would take 10 s
    row = {
        "responses_create_params": {"input": "add 1", "tools": COUNTER_TOOLS},
        "expected_count": 1,
    }  # no initial_count
    began = time.monotonic()
    with pytest.raises(
        GymServerError,
        match=rf"^NeMo Gym resources server {gym_urls['counter']} rejected POST /seed_session: "
        r"HTTP 422: .*initial_count",
    ):
        env.step([Episode(row, "e-rejected").turn("1")])
    assert time.monotonic() - began < 5
    env.close()


def test_the_registry_builds_gym_tasks_and_records_must_be_gym_rows(gym_urls):
    config = load_config(None, [f"env.gym.weather.url={gym_urls['weather']}"]).env
    check_tasks({"weather"}, config)
    env = build_env("weather", config)
    assert isinstance(env, GymResourcesEnv)
    with pytest.raises(DataError, match="must be Gym rows with responses_create_params"):
        env.step([EnvRequest(messages=[assistant("42")], record={"prompt": "?", "answer": "42"})])
    env.close()


def test_a_rendered_prompt_with_a_system_message_before_the_rows_input_is_scored_after_it(gym_urls):
    """render_prompt adds data.system_prompt before a row without its own: the Responses object
    starts after the row's input all the same."""
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(ROOT / "models" / "demo")))
    row = {**WEATHER_ROW, "responses_create_params": {"input": "sf?", "tools": [WEATHER_TOOL]}}
    prompt = render_prompt(row, tokenizer, "prompt", "You are terse.", use_chat_template=True)
    assert prompt.messages[0] == {"role": "system", "content": "You are terse."}
    env = gym_env(gym_urls["multireward"])
    (verdict,) = env.step(
        [EnvRequest(messages=prompt.messages + [assistant(SF_CALL)], record=row, episode_id="e-sys", last_turn=True)]
    )
    assert verdict.reward == 3.0  # no message item: the system and user messages are not in the output
    env.close()


def test_a_server_that_is_down_is_an_infra_failure_after_its_retries_with_one_line_naming_it():
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    env = gym_env(url, timeout_s=2.0, max_retries=2, backoff_s=0.2)
    began = time.monotonic()
    (response,) = env.step([Episode(WEATHER_ROW, "e-down").turn(SF_CALL)])
    elapsed = time.monotonic() - began
    message = response.info["infra_error"]
    assert response.infra_failure == "gym_server" and response.reward == 0.0
    assert message.startswith(
        f"NeMo Gym resources server {url} failed POST /seed_session after 3 attempts: ConnectError"
    )
    assert "\n" not in message and 0.6 <= elapsed < 5  # waited 0.2 + 0.4 s between the attempts
    env.close()


def test_a_server_gone_mid_episode_is_an_infra_failure_of_its_verify_and_the_launcher_left_nothing_running(tmp_path):
    with gym_servers({"weather": GYM_CONFIG["weather"]}, tmp_path) as urls:
        env = gym_env(urls["weather"], max_retries=1)
        episode = Episode(WEATHER_ROW, "e-gone")
        (response,) = env.step([episode.turn(SF_CALL)])
        episode.observe(response)
    port = int(urls["weather"].rsplit(":", 1)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the server still listens after gym_servers exited"
    (gone,) = env.step([episode.turn("Cold.")])
    assert gone.infra_failure == "gym_server"
    assert gone.info["infra_error"].startswith(
        f"NeMo Gym resources server {urls['weather']} failed POST /verify after 2 attempts"
    )
    env.close()


def test_a_gym_server_that_cannot_start_is_one_error_with_its_log(tmp_path):
    bad_domain = {
        "weather": {"resources_servers": {"example_single_tool_call": {"entrypoint": "app.py", "domain": "weather"}}}
    }
    began = time.monotonic()
    with pytest.raises(GymLaunchError) as error:
        with gym_servers(bad_domain, tmp_path):
            pass
    message = str(error.value)
    assert message.startswith("NeMo Gym server weather exited with status 1 before answering http://127.0.0.1:")
    assert f"last lines of {tmp_path / 'weather.log'}: " in message and "domain" in message and "\n" not in message
    assert time.monotonic() - began < 60
    with pytest.raises(GymLaunchError, match="port must be an integer, got 'eighty'"):
        with gym_servers(
            {"weather": {"resources_servers": {"example_single_tool_call": {"port": "eighty"}}}}, tmp_path
        ):
            pass
    with pytest.raises(GymLaunchError, match="example_nope/app.py does not exist"):
        with gym_servers({"x": {"resources_servers": {"example_nope": {}}}}, tmp_path):
            pass


def test_a_missing_gym_virtualenv_says_to_run_make_gym_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("REINFORGE_GYM_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(GymLaunchError, match=r"no NeMo Gym virtualenv at .*nowhere.*run `make gym-venv`"):
        gym_python()


# reinforge's environments as NeMo Gym resources servers
