"""A Gym agent whose model server points elsewhere: its episodes time out and the policy endpoint never sees a
call. That is a configuration error, one line naming the endpoint and the model server to fix (exit 2, never
restarted), not agent timeouts counted as infrastructure; an agent that did call the endpoint keeps its timeouts
as infrastructure. A real agent server on 127.0.0.1 that never calls back, and a real endpoint."""

import asyncio
import time

import pytest
from _http import QuietHandler, served

from reinforge.generation.base import SamplingParams
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.agent import AgentRollout, AgentRolloutError
from reinforge.rollout.agent_config import AgentConfig
from reinforge.rollout.infra import NO_HOLES
from reinforge.serving.app import build_app
from reinforge.serving.config import ServingConfig
from reinforge.serving.server import PolicyServer

SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, seed=0)


class Stalls(QuietHandler):
    """An agent server whose /run never calls the policy (its model server points elsewhere) and never ends."""

    def do_POST(self):
        time.sleep(3)


agent_url = served(Stalls, "agent_url")


def rollout_of(agent_url: str) -> tuple[AgentRollout, PolicyServer]:
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo")))
    server = PolicyServer(None, tokenizer, ServingConfig(), max_model_len=64, default_max_tokens=4, managed=True)
    server.start(build_app(server))
    config = AgentConfig(gym={"weather": {"url": agent_url}}, timeout_s=0.5, first_call_timeout_s=0)
    return AgentRollout(server, tokenizer, config, {}, NO_HOLES), server


def run_all(rollout: AgentRollout, server: PolicyServer, num: int):
    with server.rollout_session(SAMPLING) as session:
        return asyncio.run(rollout._run_all(session, [{"agent": "weather"}] * num))


def test_timeouts_with_no_call_ever_received_are_a_configuration_error_naming_the_endpoint(agent_url):
    rollout, server = rollout_of(agent_url)
    try:
        with pytest.raises(AgentRolloutError) as error:
            run_all(rollout, server, 2)
        line = str(error.value)
        assert "2 of 2 episodes timed out (agent.timeout_s=0.5)" in line and "\n" not in line
        assert "has received no call since the run started" in line
        assert "the Gym model server of agent weather (its vllm_model base_url) points elsewhere" in line
        assert f"policy endpoint at {server.base_url}" in line
        server.num_received = 1  # the endpoint has seen a call this run: the timeouts are the agents' (infra)
        assert [episode.result.status for episode in run_all(rollout, server, 2)] == ["timeout", "timeout"]
    finally:
        server.stop()
