"""reinforge's environments served as NeMo Gym resources servers (`reinforge env serve --protocol gym`), all real:
the Gym protocol's seed, tool and verify routes over HTTP, its guards, and GymResourcesEnv driving a reinforge
environment served that way (Gym's own servers scoring reinforge's conversations: test_gym_envs.py)."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _gym_episodes import TOKEN, Episode, call, gym_env

from reinforge.network import free_port

pytestmark = pytest.mark.xdist_group("gym")

ROOT = Path(__file__).resolve().parents[2]


CALCULATOR_ROW = {
    "responses_create_params": {
        "input": [{"role": "user", "content": "What is 57 + 34 - 49?"}],
        "tools": [
            {
                "type": "function",
                "name": "calculator",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            }
        ],
    },
    "answer": "42",
}


def gym_verify_body(final_answer: str) -> dict:
    """A Gym verify request as simple_agent posts it: the row, and a Responses object with a calculator call, its
    output and the answer."""
    output = [
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "calculator",
            "arguments": '{"expression": "57 + 34 - 49"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": final_answer, "annotations": []}],
        },
    ]
    response = {
        "id": "resp_1",
        "created_at": 0,
        "model": "policy",
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    return {**CALCULATOR_ROW, "response": response}


@contextlib.contextmanager
def tool_use_gym_server(log_dir: Path, token: str | None):
    """`reinforge env serve --protocol gym --env tool_use` in its own process; yields its URL."""
    port = free_port("127.0.0.1")
    log = (log_dir / f"server_{port}.log").open("w+")
    token_args = ["--token-env", "REINFORGE_TEST_GYM_TOKEN"] if token else []
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reinforge.cli",
            "env",
            "serve",
            "--protocol",
            "gym",
            "--env",
            "tool_use",
            "--port",
            str(port),
            *token_args,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "REINFORGE_TEST_GYM_TOKEN": token or ""},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited: {log.read()}")
            assert time.monotonic() < deadline, "server did not answer /health within 60 s"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def tool_use_gym_url(tmp_path_factory):
    with tool_use_gym_server(tmp_path_factory.mktemp("gym_serve"), TOKEN) as url:
        yield url


def post(url: str, route: str, body, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if isinstance(body, bytes):
        return httpx.post(
            f"{url}{route}", content=body, headers={**headers, "Content-Type": "application/json"}, timeout=30
        )
    return httpx.post(f"{url}{route}", json=body, headers=headers, timeout=30)


def test_the_gym_protocol_server_seeds_calls_tools_and_verifies(tool_use_gym_url):
    url = tool_use_gym_url
    assert post(url, "/seed_session", CALCULATOR_ROW).json() == {}
    calculator = post(url, "/calculator", {"expression": "57 + 34 - 49"})
    assert calculator.status_code == 200 and calculator.text == "42" and calculator.json() == 42
    bad = post(url, "/calculator", {"expression": "__import__('os')"})
    assert bad.status_code == 400 and bad.json()["detail"].startswith("tool 'calculator' rejected its arguments: ")
    right = post(url, "/verify", gym_verify_body("So it is \\boxed{42}.")).json()
    # tool_use's counters are fields of their own, not reward_components: they do not sum to the reward
    assert right == {
        **gym_verify_body("So it is \\boxed{42}."),
        "reward": 1.0,
        "mask_sample": False,
        "failure_kind": None,
        "failure_reason": None,
        "num_tool_calls": 1.0,
        "tool_result_correct": 1.0,
    }
    wrong = post(url, "/verify", gym_verify_body("So it is \\boxed{41}.")).json()
    assert (wrong["reward"], wrong["num_tool_calls"], wrong["tool_result_correct"]) == (0.0, 1.0, 1.0)
    assert "reward_components" not in wrong
    metrics = post(
        url,
        "/aggregate_metrics",
        {
            "verify_responses": [
                {**right, "_ng_task_index": 0, "_ng_rollout_index": 0},
                {**wrong, "_ng_task_index": 0, "_ng_rollout_index": 1},
            ]
        },
    ).json()
    assert metrics["key_metrics"] == {"mean/reward": 0.5}
    assert post(url, "/close_session", {}).json() == {}


def test_the_gym_protocol_server_guards_and_names_the_bad_field(tool_use_gym_url):
    url = tool_use_gym_url
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert post(url, "/seed_session", {}, token=None).status_code == 401
    assert post(url, "/calculator", {"expression": "1"}, token="wrong").status_code == 401
    no_response = {key: value for key, value in gym_verify_body("42").items() if key != "response"}
    for body, detail in [
        (no_response, "bad request: response: Field required"),
        (
            {**gym_verify_body("42"), "response": {"output": "text"}},
            "bad request: response.output: Input should be a valid list",
        ),
        (
            {**gym_verify_body("42"), "responses_create_params": {"tools": []}},
            "bad request: responses_create_params.input: Field required",
        ),
        (b'{"responses_create_params": ', "bad request: the body is not valid JSON"),
        (
            {**gym_verify_body("42"), "responses_create_params": {"input": [{"type": "web_search_call"}]}},
            "Responses item not supported",
        ),
    ]:
        response = post(url, "/verify", body)
        assert response.status_code == 422 and response.json()["detail"].startswith(detail), response.text
    assert post(url, "/seed_session", [1, 2]).status_code == 422
    wrong_type = httpx.post(
        f"{url}/verify", content=b"{}", headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"}
    )
    assert wrong_type.status_code == 415


def test_gym_resources_env_drives_a_reinforge_environment_served_the_gym_way(tmp_path):
    """Both halves together: `reinforge env serve --protocol gym --env tool_use`, driven by GymResourcesEnv."""
    with tool_use_gym_server(tmp_path, token=None) as url:
        env = gym_env(url)
        episode = Episode(CALCULATOR_ROW, "e-calc")
        (response,) = env.step([episode.turn(call("calculator", {"expression": "57 + 34 - 49"}))])
        assert response.observation == [{"role": "tool", "content": "42"}]
        episode.observe(response)
        (verdict,) = env.step([episode.turn("\\boxed{42}")])
        assert (verdict.reward, verdict.components) == (1.0, {"num_tool_calls": 1.0, "tool_result_correct": 1.0})
        env.close()
