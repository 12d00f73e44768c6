"""A NeMo Gym vision-language environment against reinforge's policy endpoint: Gym's `circle_count` resources
server (pictures of coloured circles as `input_image` parts), its `simple_agent` and `vllm_model` model server
(started from the Gym virtualenv), and `reinforge serve` of the VLM demo model. Each episode's picture reaches
the policy (its prompt holds the picture's image tokens), the policy's tokens come back with the output, and
Gym's server scores the answer."""

import json
from pathlib import Path

import httpx
import pytest
from _gym import gym_python, gym_servers, policy_model
from _servers import cli_server
from transformers import AutoTokenizer

from reinforge import loops
from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.config.loader import load_recipe_config
from reinforge.data.jsonl import read_jsonl
from reinforge.network import free_port
from reinforge.paths import PROJECT_ROOT

pytestmark = pytest.mark.xdist_group("gym")

POLICY_PORT = free_port("127.0.0.1")


@pytest.fixture(scope="module")
def gym(tmp_path_factory):
    """Gym's circle_count server, its simple_agent and vllm_model (calling POLICY_PORT); yields (urls, rows)."""
    config = {
        "circles": {"resources_servers": {"circle_count": {"entrypoint": "app.py", "domain": "other"}}},
        "circle_agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "max_steps": 1,
                    "resources_server": {"type": "resources_servers", "name": "circles"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                }
            }
        },
        "policy_model": policy_model(POLICY_PORT),
    }
    site = Path(gym_python()).parents[1] / "lib"
    rows = read_jsonl(next(site.glob("python3*/site-packages/resources_servers/circle_count/data/example.jsonl")))
    with gym_servers(config, tmp_path_factory.mktemp("gym_vlm")) as urls:
        yield urls, rows


def test_gyms_circle_count_episodes_send_their_pictures_to_the_policy(gym, tmp_path):
    urls, rows = gym
    image_token = AutoTokenizer.from_pretrained(PROJECT_ROOT / "models" / "vlm_demo").convert_tokens_to_ids("<image>")
    serve = ["serve", "--model", "models/vlm_demo", "--backend", "hf", "--max-tokens", "24"]
    with cli_server(serve, tmp_path / "serve.log", port=POLICY_PORT):
        for row in rows[:2]:
            params = {**row["responses_create_params"], "temperature": 1.0, "max_output_tokens": 24}
            answer = httpx.post(
                f"{urls['circle_agent']}/run", json={**row, "responses_create_params": params}, timeout=180
            )
            assert answer.status_code == 200, answer.text
            result = answer.json()
            assert result["reward"] in (0.0, 1.0) and result["expected_count"] > 0
            (message,) = [item for item in result["response"]["output"] if item.get("generation_token_ids")]
            assert message["prompt_token_ids"].count(image_token) == 4  # the picture, as the demo's 4 image tokens
            assert len(message["generation_token_ids"]) == len(message["generation_log_probs"]) > 0


def test_grpo_trains_on_gym_image_episodes_with_the_trainer_seeing_the_engines_pictures(gym, tmp_path):
    """The run's endpoint records each call's pictures with its tokens; the trainer scores the episodes with them:
    its logprobs equal the engine's on every step (without the pictures they would not)."""
    urls, rows = gym
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({**row, "agent_ref": {"name": "circle_agent"}}) + "\n" for row in rows[:4]))
    config = load_recipe_config(
        GRPORunConfig,
        PROJECT_ROOT / "configs" / "grpo_vlm_demo.yaml",
        [
            f"data.train_path={train}",
            "data.val_path=null",
            "loop.max_steps=2",
            "rollout.num_prompts_per_step=4",
            "rollout.num_generations_per_prompt=2",
            "training.global_batch_size=8",
            "training.micro_batch_size=8",
            "rollout.driver=agent",
            f"agent.endpoint.port={POLICY_PORT}",
            f"agent.gym.circle_agent.url={urls['circle_agent']}",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    steps = [json.loads(line) for line in (loops.train(config).run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["rollout/agent_ok_fraction"] == 1 and row["rollout/agent_contiguous_fraction"] == 1, row
        assert row["train/token_mult_prob_error"] <= 1.05, row["train/token_mult_prob_error"]
