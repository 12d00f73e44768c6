"""NeMo Gym set up wrong, as a new user would set it up, with Gym's real servers (tests/e2e/_gym.py): each run ends
with exit status 2 and one `reinforge: error:` line that names the Gym setting at fault, within seconds.

- Gym's `vllm_model` with `return_token_id_information: false`: its agent's episodes carry no token ids, so that
  none can be matched to the endpoint's records;
- a `vllm_model` whose base_url points at a port nobody serves: Gym retries it for ever, and no request ever
  reaches the endpoint (the run must not wait agent.timeout_s to say so);
- a gymnasium-style server (blackjack: `/reset`, `/step`) given as an env.gym resources server, or a resources
  server given as an agent: refused before the run directory is made.
"""

import json
import time
from pathlib import Path

import pytest
from _gym import gym_python, gym_servers

from reinforge.cli import main
from reinforge.data.jsonl import read_jsonl
from reinforge.network import free_port
from reinforge.paths import PROJECT_ROOT

pytestmark = pytest.mark.xdist_group("gym")

POLICY_PORT = free_port("127.0.0.1")  # the runs' endpoint; the no-ids model server calls it
NOBODY_PORT = free_port("127.0.0.1")  # served by nobody
SMALL = [
    "model.name_or_path=models/tool_demo",
    "data.val_path=null",
    "loop.max_steps=1",
    "rollout.num_prompts_per_step=2",
    "rollout.num_generations_per_prompt=2",
    "training.global_batch_size=4",
    "training.micro_batch_size=4",
    "rollout.max_turns=3",
    "checkpoint.save_final=false",
]


def model_server(port: int, token_ids: bool) -> dict:
    settings = {"entrypoint": "app.py", "base_url": f"http://127.0.0.1:{port}/v1", "api_key": "none"}
    settings.update(model="policy", return_token_id_information=token_ids, uses_reasoning_parser=False)
    return {"responses_api_models": {"vllm_model": settings}}


def simple_agent(model: str) -> dict:
    servers = {"resources_server": {"type": "resources_servers", "name": "multireward"}}
    servers["model_server"] = {"type": "responses_api_models", "name": model}
    return {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py", **servers}}}


@pytest.fixture(scope="module")
def gym(tmp_path_factory):
    """({instance: url}, the site-packages of the Gym virtualenv)."""
    config = {
        "multireward": {
            "resources_servers": {"example_tool_call_multireward": {"entrypoint": "app.py", "domain": "agent"}}
        },
        "no_ids_model": model_server(POLICY_PORT, token_ids=False),
        "no_ids_agent": simple_agent("no_ids_model"),
        "elsewhere_model": model_server(NOBODY_PORT, token_ids=True),
        "elsewhere_agent": simple_agent("elsewhere_model"),
        "blackjack": {"resources_servers": {"blackjack": {"entrypoint": "app.py", "domain": "games"}}},
    }
    with gym_servers(config, tmp_path_factory.mktemp("gym")) as urls:
        yield urls, next((Path(gym_python()).parents[1] / "lib").glob("python3*/site-packages"))


def rows_file(tmp_path: Path, site: Path, server: str, extra: dict) -> Path:
    rows = read_jsonl(site / "resources_servers" / server / "data" / "example.jsonl")[:2]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({**row, **extra}) + "\n" for row in rows))
    return path


def run_grpo(tmp_path: Path, capsys, *overrides: str) -> tuple[str, float]:
    """The run's one error line, and how long the run took."""
    started = time.monotonic()
    status = main(["grpo", "--config", str(PROJECT_ROOT / "configs" / "grpo_demo.yaml"), *SMALL, *overrides,
                   f"logging.run_dir={tmp_path / 'run'}"])  # fmt: skip
    elapsed, err = time.monotonic() - started, capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("reinforge: error: ")]
    assert status == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0], elapsed


def agent_run(tmp_path, capsys, site, agent: str, url: str, *overrides: str) -> tuple[str, float]:
    ref = {"agent_ref": {"type": "responses_api_agents", "name": agent}, "task": "weather"}
    data = rows_file(tmp_path, site, "example_tool_call_multireward", ref)
    return run_grpo(tmp_path, capsys, f"data.train_path={data}", "rollout.driver=agent",
                    f"agent.endpoint.port={POLICY_PORT}", f"agent.gym.{agent}.url={url}", *overrides)  # fmt: skip


def test_a_gym_model_server_that_returns_no_token_ids_is_named_with_the_setting_that_fixes_it(gym, tmp_path, capsys):
    urls, site = gym
    line, _ = agent_run(tmp_path, capsys, site, "no_ids_agent", urls["no_ids_agent"])
    assert "(no_calls)" in line and "Gym agent no_ids_agent reported" in line, line
    assert "set `return_token_id_information: true` on its model server" in line, line
    logged = [json.loads(row) for row in (tmp_path / "run" / "agent_errors.jsonl").read_text().splitlines()]
    assert logged and all("return_token_id_information" in row["error"] for row in logged)


def test_a_gym_model_server_pointed_elsewhere_is_named_within_seconds_not_at_the_timeout(gym, tmp_path, capsys):
    urls, site = gym
    line, elapsed = agent_run(tmp_path, capsys, site, "elsewhere_agent", urls["elsewhere_agent"],
                              "agent.first_call_timeout_s=3", "agent.timeout_s=120")  # fmt: skip
    assert "no request reached the policy endpoint within agent.first_call_timeout_s=3" in line, line
    assert f"set its base_url to http://127.0.0.1:{POLICY_PORT}/v1" in line, line
    assert elapsed < 100, elapsed  # model load, start-up probe, then 3 s; not agent.timeout_s


def test_a_gymnasium_style_server_on_the_env_path_is_refused_before_the_run_directory(gym, tmp_path, capsys):
    urls, site = gym
    data = rows_file(tmp_path, site, "blackjack", {"task": "blackjack"})
    line, _ = run_grpo(tmp_path, capsys, f"data.train_path={data}", f"env.gym.blackjack.url={urls['blackjack']}")
    assert f"env.gym.blackjack.url={urls['blackjack']} is a gymnasium-style NeMo Gym server (/reset, /step)" in line
    assert not (tmp_path / "run").exists()


def test_a_resources_server_given_as_a_gym_agent_is_refused_before_the_run_directory(gym, tmp_path, capsys):
    urls, site = gym
    line, _ = agent_run(tmp_path, capsys, site, "no_ids_agent", urls["multireward"])
    assert f"agent.gym.no_ids_agent.url={urls['multireward']} is not a NeMo Gym agent server: it has no /run" in line
    assert not (tmp_path / "run").exists()
