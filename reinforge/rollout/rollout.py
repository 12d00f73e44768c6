"""Rollouts: sample G answers per prompt and let each record's environment score them, over as many
turns as the environments ask for (up to `max_turns`).

Turn 1 samples G completions per prompt. Each trajectory is then scored by its record's task
environment (`record["task"]`, else `env.default_task`; one batch may mix tasks). An environment may
answer "not done" with observations (tool results): they are rendered with the chat template,
appended to the trajectory as tokens with loss mask 0 and logprob 0, and the trajectory takes
another turn (one completion, continuing its own token sequence, so the engine's prefix cache
serves it). A trajectory ends when its environment says done, or after `max_turns` policy turns.
Its reward is the last turn's or the sum over turns; the `extra_rewards` environments then score
its final answer and add their weighted rewards as components. With `max_turns=1` this is plain
single-turn GRPO. With `params.record_routes` (router replay) a trajectory's routes are those of its last
engine call, which ran all its earlier tokens (turns and observations) as its prompt: one forward's routes
for every token but the last (generation/routes.py).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from pydantic import Field, model_validator
from transformers import PreTrainedTokenizerBase

from reinforge.config.section import Section
from reinforge.data.batch import Trajectory
from reinforge.data.prompts import Prompt
from reinforge.data.tool_calls import TOOL_CALL_END  # a turn that calls a tool ends there: the observation comes next
from reinforge.envs.base import Environment, EnvRequest, EnvResponse
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.logging.metrics import RoundMetrics, Timers
from reinforge.rollout.infra import InfraLimits, settle
from reinforge.rollout.single_turn import generate_trajectories


class RolloutConfig(Section):
    """`rollout:` how a step's trajectories are produced: who drives the episodes, how many, over how many turns,
    and when generation runs (beside training, ahead of it, or without ever stopping)."""

    driver: Literal["reinforge", "agent"] = "reinforge"
    """Who drives an episode: `reinforge` samples the turns itself and asks the environments (env.*);
    `agent` hands each episode to an agent (agent.*: a NeMo Gym agent server, or your own Python
    function) that calls the policy through the run's OpenAI-compatible endpoint; the trajectory is
    rebuilt from what the endpoint recorded (docs/agents.md)."""
    num_prompts_per_step: int = Field(default=16, ge=1)
    """Distinct prompts per step."""
    num_generations_per_prompt: int = 8
    """Completions sampled per prompt (the group size G; at least 2)."""
    max_turns: int = Field(default=1, ge=1)
    """Policy turns per trajectory: above 1, an environment may answer a turn with observations (tool
    results) that are appended as tokens, never trained on, and the policy continues."""
    turn_reward: Literal["last", "sum"] = "last"
    """Multi-turn reward: the last turn's, or the sum over turns (e.g. with per-call penalties)."""
    max_observation_tokens: int = 256
    """Longest observation appended in one turn; longer ones are cut (the chat template's framing kept)."""
    mode: Literal["sync", "async", "in_flight"] = "sync"
    """When rollouts are generated. `sync`: each step's batch when the step starts, by the policy the last refit
    installed. `async`: the next steps' batches while the current step trains, each by one policy at most
    `max_staleness` versions behind; the engine pauses for each refit, and the engines run as Ray actors with
    resources of their own (`generation.num_workers` x `cluster.num_cpus_per_worker` / `num_gpus_per_worker`;
    with FSDP2, `cluster.colocate=false`). `in_flight`: the engine never stops: a pool of prompts is always
    being generated, finished groups stream to the trainer, and each refit lands between two decoding steps
    with the requests kept, so one sequence may span several policy versions (every token records its own;
    `max_staleness` bounds the oldest token's; docs/algorithms.md "In-flight generation")."""
    max_staleness: int = Field(default=1, ge=0)
    """With `mode=async` or `in_flight`: the most training steps the policy that generated a batch (in flight:
    a trajectory's oldest token) may lag behind the policy that trains on it. Under `async`, 0 is synchronous
    (same metrics as `mode=sync`) and 1 overlaps each step's training with the next step's generation; under
    `in_flight` a group whose oldest token is older is generated again from its prompt (never trained on, its
    prompt not lost)."""
    in_flight_kv_cache: Literal["keep", "recompute"] = "keep"
    """With `mode=in_flight`, a request's KV cache when new weights land while it runs: `keep` (the keys and
    values of its earlier tokens stay as the older weights computed them, as in PipelineRL) or `recompute` (vLLM
    only: dropped, and recomputed from the new weights when the request is scheduled again)."""
    in_flight_pool_groups: int | None = Field(default=None, ge=1)
    """With `mode=in_flight`: prompts (groups of `num_generations_per_prompt`) kept in generation at once;
    null: twice `num_prompts_per_step`, so a step's worth is always being generated while another is trained."""

    @property
    def pool_groups(self) -> int:
        """`in_flight_pool_groups`, resolved."""
        return self.in_flight_pool_groups or 2 * self.num_prompts_per_step

    version_check: bool = False
    """With `mode=async` or `in_flight`: compare every trained token with the weights of the policy version that
    sampled it (`train/version_matched/*`): the trainer keeps its trained parameters of the last
    `max_staleness + 1` versions (on the CPU) and runs one more logprobs pass per older version in a step.
    Off: only the tokens of the trainer's current version are compared (no extra pass)."""
    max_infra_retries: int = Field(default=2, ge=0)
    """Re-runs, from its prompt with a fresh session, of an episode whose infrastructure failed (an
    environment or Gym server error, a sandbox crashed or killed from outside, an HTTP failure or
    timeout; docs/environments.md); one still failing after them is masked: never trained on and left
    out of its group's baseline and statistics."""
    min_valid_per_group: int = Field(default=2, ge=1)
    """A group left with fewer valid (not masked for infrastructure) samples than this is dropped from
    the step (counted in rollout/infra_groups_dropped); at most the group size."""
    max_infra_failure_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """The run stops, with one line naming the failure and its component, when more than this fraction
    of a step's episodes are still masked for infrastructure after the retries, or no group is left."""

    @model_validator(mode="after")
    def _check_groups(self) -> "RolloutConfig":
        if self.num_generations_per_prompt < 2:
            raise ValueError(
                "rollout.num_generations_per_prompt must be at least 2: a group baseline needs two samples; "
                "set it to 2 or more"
            )
        if self.min_valid_per_group > self.num_generations_per_prompt:
            raise ValueError(
                f"rollout.min_valid_per_group={self.min_valid_per_group} is more than a group has "
                f"(rollout.num_generations_per_prompt={self.num_generations_per_prompt}); set it to at most that"
            )
        return self


_MARK = "\u2063reinforge\u2063"  # an unlikely string, to find where the template closes a message


@dataclass
class RolloutOptions:
    default_task: str  # for records without a `task`
    max_turns: int = 1
    turn_reward: str = "last"  # "last" or "sum"
    max_observation_tokens: int = 256
    extra_rewards: dict[str, float] | None = None  # env name -> weight, on every final answer


class Episodes(Protocol):
    """Who drives the episodes of a rollout: reinforge (`ReinforgeRollout`) or agents (rollout/agent.py)."""

    def __call__(self, prompts: list[Prompt], params: SamplingParams, timers: Timers | None = None) -> list[Trajectory]:
        """`params.num_samples` scored trajectories per prompt, grouped by prompt, in prompt order."""
        ...

    def metrics(self) -> dict[str, float]:
        """The drivers' own counters of the rollouts since the last call (rollout/agent_*), then reset."""
        ...


class ReinforgeRollout:
    """`rollout` with its engine, tokenizer, environments and options bound: the episodes reinforge
    drives itself, behind the same call as agent rollouts (rollout/agent.py)."""

    def __init__(
        self,
        engine: GenerationBackend,
        tokenizer: PreTrainedTokenizerBase,
        envs: dict[str, Environment],
        options: RolloutOptions,
        infra: InfraLimits,
    ):
        self.engine, self.tokenizer, self.envs, self.options, self.infra = engine, tokenizer, envs, options, infra
        self._metrics = RoundMetrics()

    def __call__(self, prompts: list[Prompt], params: SamplingParams, timers: Timers | None = None) -> list[Trajectory]:
        """The rollout, with its infrastructure failures retried (each from its prompt, a new episode id),
        masked and their groups dropped (rollout/infra.py)."""
        trajectories, metrics = settled_rollout(
            prompts, self.engine, params, self.tokenizer, self.envs, self.options, self.infra, timers
        )
        self._metrics.add(metrics)
        return trajectories

    def metrics(self) -> dict[str, float]:
        """The rollouts' rollout/infra_* since the last call (the environments report their own, env/<task>/...)."""
        return self._metrics.take()


def rollout(
    prompts: list[Prompt],
    engine: GenerationBackend,
    params: SamplingParams,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, Environment],
    options: RolloutOptions,
    timers: Timers | None = None,
) -> list[Trajectory]:
    """`params.num_samples` scored trajectories per prompt, grouped by prompt, in prompt order; time in
    the engine and in the environments goes to `timers` as `generate` and `reward`."""
    timers = timers or Timers()
    if options.max_turns > 1 and TOOL_CALL_END not in params.stop_strings:
        params = replace(params, stop_strings=params.stop_strings + (TOOL_CALL_END,))
    with timers.time("generate"):
        trajectories = generate_trajectories(prompts, engine, params, tokenizer)
    for trajectory in trajectories:
        trajectory.task = prompts[trajectory.group].record.get("task", options.default_task)
        trajectory.response_mask = [1] * len(trajectory.response_ids)
    conversations = [prompts[t.group].messages + [_assistant(t.response_text)] for t in trajectories]
    episode_ids = [f"{uuid.uuid4().hex[:12]}-{index}" for index in range(len(trajectories))]
    turn_rewards: list[list[float]] = [[] for _ in trajectories]
    active = list(range(len(trajectories)))
    for turn in range(1, options.max_turns + 1):
        with timers.time("reward"):
            responses = _step_by_task(
                active, trajectories, conversations, prompts, envs, episode_ids, last_turn=turn == options.max_turns
            )
        continuing = []
        for index, response in zip(active, responses):
            turn_rewards[index].append(response.reward)
            if response.infra_failure:  # no verdict: the episode ends here, and is retried (rollout/infra.py)
                trajectories[index].infra_failure = response.infra_failure
                trajectories[index].infra_error = response.info.get("infra_error", "")
                continue
            trajectories[index].components.update(response.components)
            trajectories[index].masked |= response.mask_sample
            if response.done or not response.observation or turn == options.max_turns or trajectories[index].truncated:
                continue
            trajectory = trajectories[index]
            ended_with_eos = bool(trajectory.response_ids) and trajectory.response_ids[-1] == tokenizer.eos_token_id
            observation_ids = observation_token_ids(
                tokenizer, response.observation, ended_with_eos, options.max_observation_tokens
            )
            trajectory.response_ids += observation_ids
            trajectory.response_mask += [0] * len(observation_ids)
            trajectory.gen_logprobs += [0.0] * len(observation_ids)
            if trajectory.token_versions:
                trajectory.token_versions += trajectory.token_versions[-1:] * len(observation_ids)
            conversations[index] += response.observation
            continuing.append(index)
        if not continuing:
            break
        with timers.time("generate"):
            result = engine.generate(
                [trajectories[i].prompt_ids + trajectories[i].response_ids for i in continuing],
                replace(params, num_samples=1, seed=params.seed + 7_919 * turn),
            )
        for index, (completion,) in zip(continuing, result.completions):
            trajectory = trajectories[index]
            trajectory.response_ids += completion.token_ids
            trajectory.response_mask += [1] * len(completion.token_ids)
            trajectory.gen_logprobs += completion.logprobs
            if trajectory.token_versions is not None and completion.token_versions is not None:
                trajectory.token_versions += completion.token_versions
            trajectory.routed_experts = completion.routed_experts  # this call ran every earlier token as its prompt
            trajectory.truncated = completion.finish_reason == "length"
            trajectory.response_text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            trajectory.num_turns += 1
            conversations[index].append(_assistant(trajectory.response_text))
        active = continuing
    for trajectory, rewards in zip(trajectories, turn_rewards):
        trajectory.reward = sum(rewards) if options.turn_reward == "sum" else rewards[-1]
    with timers.time("reward"):
        _add_extra_rewards(trajectories, conversations, prompts, envs, options.extra_rewards or {})
    return trajectories


def settled_rollout(
    prompts: list[Prompt],
    engine: GenerationBackend,
    params: SamplingParams,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, Environment],
    options: RolloutOptions,
    infra: InfraLimits,
    timers: Timers | None = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """`rollout`, with the episodes that failed on infrastructure run again from their prompt (a new episode
    id each, one sample, a seed of its own per retry), masked if they keep failing, and their groups dropped
    (rollout/infra.py); and the rollout/infra_* metrics."""
    trajectories = rollout(prompts, engine, params, tokenizer, envs, options, timers)

    def rerun(indices: list[int], retry: int) -> list[Trajectory]:
        again = [prompts[trajectories[index].group] for index in indices]
        fresh_params = replace(params, num_samples=1, seed=params.seed + 104_729 * (retry + 1))
        return rollout(again, engine, fresh_params, tokenizer, envs, options, timers)

    return settle(trajectories, params.num_samples, rerun, infra)


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _step_by_task(
    indices: list[int],
    trajectories: list[Trajectory],
    conversations: list[list[dict[str, str]]],
    prompts: list[Prompt],
    envs: dict[str, Environment],
    episode_ids: list[str],
    last_turn: bool,
) -> list[EnvResponse]:
    """One `step` call per task environment; responses in the order of `indices`. A truncated answer is
    the trajectory's last turn too: the rollout does not continue it."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for position, index in enumerate(indices):
        by_task[trajectories[index].task].append(position)
    responses: list[EnvResponse | None] = [None] * len(indices)
    for task, positions in by_task.items():
        requests = [
            EnvRequest(
                messages=conversations[i],
                record=prompts[trajectories[i].group].record,
                episode_id=episode_ids[i],
                last_turn=last_turn or trajectories[i].truncated,
            )
            for i in (indices[p] for p in positions)
        ]
        for position, response in zip(positions, envs[task].step(requests)):
            responses[position] = response
    return responses  # type: ignore[return-value]


def _add_extra_rewards(
    trajectories: list[Trajectory],
    conversations: list[list[dict[str, str]]],
    prompts: list[Prompt],
    envs: dict[str, Environment],
    weights: dict[str, float],
) -> None:
    if weights:  # the task's own reward, apart from the extras (val/<task>/task_reward_mean: accuracy alone)
        for trajectory in trajectories:
            trajectory.components["task_reward"] = trajectory.reward
    for name, weight in weights.items():
        requests = [
            EnvRequest(messages=conversations[i], record=prompts[t.group].record) for i, t in enumerate(trajectories)
        ]
        for trajectory, response in zip(trajectories, envs[name].step(requests)):
            if response.infra_failure and not trajectory.infra_failure:
                trajectory.infra_failure = response.infra_failure
                trajectory.infra_error = response.info.get("infra_error", "")
            trajectory.components[name] = response.reward
            trajectory.reward += weight * response.reward


def observation_token_ids(
    tokenizer: PreTrainedTokenizerBase, observation: list[dict[str, str]], ended_with_eos: bool, max_tokens: int
) -> list[int]:
    """The tokens between the policy's turn and its next one: whatever closes the assistant message
    (unless the policy's EOS already did), the observation messages, and the next assistant header,
    all as the chat template renders them. The content is cut so that the whole fits `max_tokens`."""
    if tokenizer.chat_template is None:
        text = "".join("\n" + message["content"] for message in observation) + "\n"
        return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    before = [{"role": "user", "content": "."}, _assistant(_MARK)]
    closed = tokenizer.apply_chat_template(before, tokenize=False)
    closing = closed[closed.index(_MARK) + len(_MARK) :]
    if ended_with_eos and tokenizer.eos_token and closing.startswith(tokenizer.eos_token):
        closing = closing[len(tokenizer.eos_token) :]
    framed = tokenizer.apply_chat_template(
        before + [dict(m, content=_MARK) for m in observation], tokenize=False, add_generation_prompt=True
    )[len(closed) :]
    pieces = framed.split(_MARK)  # the framing around each observation message's content
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    framing_ids = [encode(piece) for piece in [closing + pieces[0]] + pieces[1:]]
    budget = max(max_tokens - sum(map(len, framing_ids)), 0) // len(observation)
    ids = list(framing_ids[0])
    for message, after in zip(observation, framing_ids[1:]):
        ids += encode(message["content"])[:budget] + after
    return ids
