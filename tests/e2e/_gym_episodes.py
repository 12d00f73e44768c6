"""Conversations as the rollout drives them against a NeMo Gym resources server, for the Gym tests: a tool call in
the policy's text, an assistant message, an episode's turns and observations, a GymResourcesEnv on a URL."""

import json

from reinforge.data.responses_format import create_params_to_chat
from reinforge.envs.base import EnvRequest
from reinforge.envs.gym import GymResourcesEnv
from reinforge.envs.gym_config import GymResourcesConfig

TOKEN = "gym-test-token-91c4"


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


class Episode:
    """One trajectory as the rollout drives it: the row's prompt, then turns and their observations."""

    def __init__(self, row: dict, episode_id: str):
        self.row, self.episode_id = row, episode_id
        self.messages = list(create_params_to_chat(row["responses_create_params"])[0])

    def turn(self, text: str, last_turn: bool = False) -> EnvRequest:
        self.messages.append(assistant(text))
        return EnvRequest(
            messages=list(self.messages), record=self.row, episode_id=self.episode_id, last_turn=last_turn
        )

    def observe(self, response) -> None:
        assert not response.done
        self.messages += response.observation


def gym_env(url: str, **overrides) -> GymResourcesEnv:
    return GymResourcesEnv(GymResourcesConfig(**{"url": url, "timeout_s": 10.0, "backoff_s": 0.1, **overrides}))
