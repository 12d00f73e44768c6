"""Start-up checks of an RL run's inputs that need more than its config can see: the model directory (weights, its
context length, its experts), the records (the math verifier's answers), the agents' code and the kind of each
env.gym server. They run before the run directory is made (rl_loop.py), so that such an input is one line and never a
half-made run directory, nor a run that trains on sequences its model cannot position."""

from __future__ import annotations

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.data.prompts import Prompt
from reinforge.envs.gym import check_resources_server
from reinforge.envs.registry import EnvConfig
from reinforge.errors import ConfigError, DataError
from reinforge.modeling import check_weights, model_limits
from reinforge.rollout.agent_runners import check_agent_server, import_agent


def check_run_inputs(config: RLRunConfig, prompts: list[Prompt]) -> None:
    check_weights(config.model)
    check_context_length(config)
    check_router_replay(config)
    if config.rollout.driver == "reinforge":
        check_math_records(prompts, config.env)
    for task, gym in config.env.gym.items():
        check_resources_server(task, gym.url)  # a gymnasium-style server (/reset, /step) is refused here
    if config.rollout.driver == "agent":
        for path in config.agent.python.values():
            import_agent(path)  # a module that does not import, or has no such function: one line
        for name, gym in config.agent.gym.items():
            check_agent_server(name, gym.url)  # a resources server given as an agent, say


def check_context_length(config: RLRunConfig) -> None:
    """The longest sequence a rollout can make must fit the model's `max_position_embeddings` (past it, a
    rotary model computes positions it was never trained on, and says nothing)."""
    limit = model_limits(config.model).max_positions
    if limit is None:
        return
    where = f"the model's max_position_embeddings={limit} ({config.model.name_or_path})"
    if config.generation.vllm.max_model_len:
        if config.generation.vllm.max_model_len > limit:
            raise ConfigError(
                f"generation.vllm.max_model_len={config.generation.vllm.max_model_len} exceeds {where}; "
                f"lower it to {limit} or less"
            )
        return
    longest = config.max_sequence_tokens
    if longest <= limit:
        return
    rollout, turns = config.rollout, ""
    if rollout.max_turns > 1:
        turns = (
            f" x rollout.max_turns={rollout.max_turns} + (rollout.max_turns - 1) x "
            f"rollout.max_observation_tokens={rollout.max_observation_tokens}"
        )
    raise ConfigError(
        f"data.max_prompt_tokens={config.data.max_prompt_tokens} + generation.max_new_tokens="
        f"{config.generation.max_new_tokens}{turns} = {longest} tokens exceeds {where}; lower data.max_prompt_tokens "
        f"or generation.max_new_tokens{' (or rollout.max_turns)' if turns else ''}"
    )


def check_router_replay(config: RLRunConfig) -> None:
    """Router replay forces the trainer's MoE routers to the engine's choices: a model without experts has none."""
    if config.model.moe.router_replay != "off" and not model_limits(config.model).num_experts:
        raise ConfigError(
            f"model.moe.router_replay={config.model.moe.router_replay}: model.name_or_path={config.model.name_or_path} "
            "has no experts (a dense model: its config.json names no num_experts); set model.moe.router_replay=off"
        )


def check_math_records(prompts: list[Prompt], env: EnvConfig) -> None:
    """Records the built-in math verifier scores must carry their gold `answer` (else the first scoring stops the
    run, once the model has loaded)."""
    if "math" in {*env.custom, *env.remote, *env.gym}:
        return
    for prompt in prompts:
        if prompt.record.get("task", env.default_task) == "math" and "answer" not in prompt.record:
            shown = str(prompt.record.get("prompt", ""))[:60]
            raise DataError(
                f"a record of task math has no 'answer' (prompt {shown!r}; fields: {', '.join(prompt.record)}); "
                "the math verifier needs each record's gold answer, or give the record another task"
            )
