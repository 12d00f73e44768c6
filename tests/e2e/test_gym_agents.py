"""NeMo Gym's own agents driving reinforge's policy: Gym's `simple_agent` and `vllm_model` model server
(started from the Gym virtualenv) pointed at reinforge's endpoint, against Gym's real
`example_tool_call_multireward` resources server and against reinforge's `tool_use` environment served
the Gym way (`reinforge env serve --protocol gym`).

First Gym's agent runs episodes against a standalone `reinforge serve`: reinforge's resources server
scores them as the in-process environment scores the same conversations. Then a GRPO run trains for 3
steps on episodes driven by Gym's agents (records of both servers in one batch): rewards and
reward_components come from the servers, every episode is contiguous, the trainer agrees with the
engine on every step.
"""

import json
from pathlib import Path

import httpx
import pytest
from _gym import gym_python, gym_servers, policy_model
from _servers import cli_server

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.data.jsonl import read_jsonl
from reinforge.data.responses_format import create_params_to_chat, hermes_messages, items_to_chat, verdict_components
from reinforge.envs.base import EnvRequest
from reinforge.envs.math_env import MathEnv
from reinforge.envs.tool_use import ToolUseEnv, ToolUseEnvConfig
from reinforge.network import free_port

pytestmark = pytest.mark.xdist_group("gym")

ROOT = Path(__file__).resolve().parents[2]
POLICY_PORT = free_port(
    "127.0.0.1"
)  # Gym's model server calls this port: reinforge serve's, then the GRPO run's endpoint


def agent(resources: str) -> dict:
    return {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": resources},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
            }
        }
    }


@pytest.fixture(scope="module")
def gym(tmp_path_factory):
    """Gym's servers, reinforge's tool_use resources server; yields ({instance: url}, multireward rows)."""
    logs = tmp_path_factory.mktemp("gym")
    with cli_server(
        ["env", "serve", "--protocol", "gym", "--env", "tool_use", "tool_use.tools=[calculator]"],
        logs / "calculator.log",
    ) as (calc, _, _):
        config = {
            "multireward": {
                "resources_servers": {"example_tool_call_multireward": {"entrypoint": "app.py", "domain": "agent"}}
            },
            "calculator": {
                "resources_servers": {
                    "reinforge_tool_use": {
                        "entrypoint": "app.py",
                        "domain": "agent",
                        "host": "127.0.0.1",
                        "port": int(calc.rsplit(":", 1)[1]),
                    }
                }
            },
            "weather_agent": agent("multireward"),
            "calculator_agent": agent("calculator"),
            "policy_model": policy_model(POLICY_PORT),
        }
        with gym_servers(config, logs, external=("calculator",)) as urls:
            site = Path(gym_python()).parents[1] / "lib"
            data = next(
                site.glob("python3*/site-packages/resources_servers/example_tool_call_multireward/data/example.jsonl")
            )
            yield urls, read_jsonl(data)


def tool_rows(count: int) -> list[dict]:
    return [
        {**row, "agent_ref": {"type": "responses_api_agents", "name": "calculator_agent"}}
        for row in read_jsonl(ROOT / "data" / "tool_demo" / "val.jsonl")[:count]
    ]


def test_gyms_simple_agent_scores_with_reinforges_tool_env_as_the_in_process_env_does(gym, tmp_path):
    urls, _ = gym
    local = ToolUseEnv(ToolUseEnvConfig(tools=["calculator"]), answer_env=MathEnv())
    with cli_server(
        ["serve", "--model", "models/tool_demo", "--max-tokens", "48"], tmp_path / "serve.log", port=POLICY_PORT
    ):
        results = []
        for row in tool_rows(12):
            params = {**row["responses_create_params"], "temperature": 1.0, "top_p": 1.0, "max_output_tokens": 48}
            answer = httpx.post(
                f"{urls['calculator_agent']}/run", json={**row, "responses_create_params": params}, timeout=120
            )
            assert answer.status_code == 200, answer.text
            results.append((row, answer.json()))
    called = 0
    for row, result in results:
        output = result["response"]["output"]
        conversation = create_params_to_chat(row["responses_create_params"])[0] + items_to_chat(output)
        (expected,) = local.step([EnvRequest(messages=hermes_messages(conversation), record=row)])
        assert result["reward"] == expected.reward and verdict_components(result, row) == expected.components
        called += any(item["type"] == "function_call" for item in output)
        carrying = [item for item in output if item.get("generation_token_ids")]
        assert carrying and all(len(i["generation_token_ids"]) == len(i["generation_log_probs"]) for i in carrying)
        for before, after in zip(carrying, carrying[1:]):  # reinforge's splice: each call extends the one before
            assert (
                after["prompt_token_ids"][: len(before["prompt_token_ids"]) + len(before["generation_token_ids"])]
                == before["prompt_token_ids"] + before["generation_token_ids"]
            )
    assert called, "the tool demo model called its calculator in none of 12 episodes"


def test_grpo_trains_on_episodes_gyms_simple_agent_drives(gym, tmp_path):
    urls, weather = gym
    rows = [
        {**row, "task": "weather", "agent_ref": {"type": "responses_api_agents", "name": "weather_agent"}}
        for row in weather[:4]
    ]
    rows += tool_rows(4)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(
        ROOT / "configs" / "grpo_demo.yaml",
        [
            "model.name_or_path=models/tool_demo",
            f"data.train_path={train}",
            "data.val_path=null",
            "loop.max_steps=3",
            "rollout.num_prompts_per_step=8",
            "rollout.num_generations_per_prompt=4",
            "training.global_batch_size=32",
            "training.micro_batch_size=32",
            "rollout.max_turns=3",
            "rollout.driver=agent",
            f"agent.endpoint.port={POLICY_PORT}",
            f"agent.gym.weather_agent.url={urls['weather_agent']}",
            f"agent.gym.calculator_agent.url={urls['calculator_agent']}",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = loops.train(config)
    steps = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == [1, 2, 3]
    for row in steps:
        assert row["rollout/agent_ok_fraction"] == 1 and row["rollout/agent_contiguous_fraction"] == 1, row
        assert row["rollout/agent_unclaimed_calls"] == 0
        assert row["train/token_mult_prob_error"] <= 1.05
        components = [row[f"train/weather/{name}_mean"] for name in ("correctness", "schema_valid", "format")]
        assert row["train/weather/reward_mean"] == pytest.approx(sum(components))  # Gym's reward is their sum
        assert "train/tool_use/num_tool_calls_mean" in row and "train/tool_use/tool_result_correct_mean" in row
        assert row["endpoint/requests"] >= 32 and row["endpoint/rejected"] == 0
