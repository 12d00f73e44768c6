"""Agent rollouts (`rollout.driver=agent`): each episode is driven by an agent that calls the policy
through the run's OpenAI-compatible endpoint; the trajectory is rebuilt from what the endpoint itself
recorded for that episode, never from re-tokenised text.

Per rollout: the endpoint opens a session with the rollout's sampling settings; G episodes per prompt
run concurrently (rollout/agent_runners.py: a NeMo Gym agent server, or your Python function); when
they have ended, each episode's model calls are looked up in the endpoint's record (serving/recorder.py:
by the episode's own URL for a Python agent, by the exact token ids a Gym agent reports for each call)
and joined into one trajectory:

    prompt = call 1's prompt; response = gen 1, [call 2's prompt after prompt 1 + gen 1], gen 2, ...

with the loss on the generated tokens only (the tokens between calls, the tool results and chat
framing the agent added, are untrained) and the engine's logprobs of each. Each call's prompt must
extend everything before it token for token (the endpoint's prefix splice makes it so for an agent
that sends back the assistant messages it got). An episode that breaks this, makes a call the endpoint
did not record, makes no call, or fails by the agent's own doing is masked (never trained on; its
reward, 0 when it has none, still counts in its group's baseline) and counted in `rollout/agent_*`.
An episode that failed on infrastructure (a Gym server's 5xx or no answer, an HTTP failure inside a
Python agent, agent.timeout_s) is no verdict at all: it is run again as a new episode, then masked and
left out of its group's statistics (rollout/infra.py, `rollout/infra_*`). `reward_components`
are the trajectory's components (per-component metrics); `mask_sample` masks it. With router replay the
trajectory's routes are the last joined call's: its prompt is everything before its generation, so that one
engine call routed every token of the trajectory but the last (generation/routes.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from transformers import PreTrainedTokenizerBase

from reinforge.data.batch import Trajectory
from reinforge.data.prompts import Prompt
from reinforge.errors import DataError, ReinforgeError
from reinforge.generation.base import SamplingParams
from reinforge.logging.metrics import RoundMetrics, Timers
from reinforge.rollout.agent_config import AgentConfig
from reinforge.rollout.agent_runners import EpisodeResult, GymAgentRunner, PythonAgentRunner, stamped_row
from reinforge.rollout.infra import InfraLimits, settle
from reinforge.serving.recorder import RecordedCall
from reinforge.serving.server import PolicyServer, RolloutSession


class AgentRolloutError(ReinforgeError):
    """Every episode of a rollout failed: nothing to learn from, and most likely a broken agent or server."""


@dataclass
class EpisodeTokens:
    """An episode's calls joined into one sequence."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 on generated tokens
    gen_logprobs: list[float]  # 0 off the mask
    truncated: bool  # its last call hit the length limit
    contiguous: bool  # every call's prompt extended all that came before it
    routed_experts: np.ndarray | None = None  # the last joined call's routes: it ran all earlier tokens as its prompt
    token_versions: list[int] | None = None
    """Per response token, the policy version that sampled it (an observation token: the one before it's); None
    when a call does not say (only in-flight engines do)."""
    images: Any = None  # the last joined call's prompt images (data/images.py): every image of the episode so far


def join_calls(calls: list[RecordedCall]) -> EpisodeTokens:
    """The episode's calls (in order, at least one) as one sequence; when a call's prompt does not start
    with everything before it, the sequence stops before that call and `contiguous` is False."""
    first = calls[0]
    response_ids, mask, logprobs = list(first.generation_ids), [1] * len(first.generation_ids), list(first.logprobs)
    versions = list(first.token_versions or [])
    seen = first.prompt_ids + first.generation_ids
    contiguous, last, labelled = True, first, first.token_versions is not None
    for call in calls[1:]:
        if call.prompt_ids[: len(seen)] != seen:
            contiguous = False
            break
        between = call.prompt_ids[len(seen) :]
        response_ids += between + call.generation_ids
        mask += [0] * len(between) + [1] * len(call.generation_ids)
        logprobs += [0.0] * len(between) + list(call.logprobs)
        labelled = labelled and call.token_versions is not None
        versions += versions[-1:] * len(between) + list(call.token_versions or [])  # observations: the token before's
        seen, last = call.prompt_ids + call.generation_ids, call
    routes = last.routed_experts
    return EpisodeTokens(
        list(first.prompt_ids),
        response_ids,
        mask,
        logprobs,
        last.truncated,
        contiguous,
        routes,
        versions if labelled else None,
        last.images,
    )


def agent_of(record: dict[str, Any], config: AgentConfig) -> str:
    """The agent that drives `record`'s episodes: its `agent_ref.name` (Gym's field) or `agent`, else `agent.default`,
    else the only agent configured."""
    ref = record.get("agent_ref")
    name = ref.get("name") if isinstance(ref, dict) else record.get("agent")
    name = name or config.default or (config.names()[0] if len(config.names()) == 1 else "")
    if name not in config.names():
        raise DataError(
            f"a record names agent {name!r}, which is not configured (agent.python / agent.gym: "
            f"{', '.join(config.names())}); set agent.default or give each record an agent_ref"
        )
    return name


@dataclass
class Episode:
    """One episode as it ended."""

    result: EpisodeResult
    calls: list[RecordedCall] | None  # what the endpoint recorded for it (None: a Gym call it did not make)
    duration_s: float


def episode_status(episode: Episode, tokens: EpisodeTokens | None) -> str:
    """ok, or why the episode is not trained on: failed, timeout, unrecorded, no_calls, noncontiguous."""
    if episode.result.status != "ok":
        return episode.result.status
    if episode.calls is None:
        return "unrecorded"
    if tokens is None:
        return "no_calls"
    return "ok" if tokens.contiguous else "noncontiguous"


class AgentRollout:
    """Prompts in, scored trajectories out, like rollout/rollout.py's `rollout`, with agents driving."""

    STATUSES = ("ok", "failed", "timeout", "unrecorded", "no_calls", "noncontiguous")

    MAX_ERRORS_LOGGED = 20  # per rollout

    def __init__(
        self,
        server: PolicyServer,
        tokenizer: PreTrainedTokenizerBase,
        config: AgentConfig,
        servers: dict[str, str],
        infra: InfraLimits,
        errors_path: Path | None = None,
    ):
        """`infra`: how episodes that fail on infrastructure are retried and masked (rollout/infra.py);
        `errors_path`: a JSONL file that gets the first MAX_ERRORS_LOGGED errors of each rollout's attempt (why
        an episode failed)."""
        self.server, self.tokenizer, self.config, self.servers, self.errors_path = (
            server,
            tokenizer,
            config,
            servers,
            errors_path,
        )
        self.infra = infra
        self.runners: dict[str, GymAgentRunner | PythonAgentRunner] = {
            **{name: PythonAgentRunner(name, path, config.timeout_s) for name, path in config.python.items()},
            **{
                name: GymAgentRunner(name, gym.url, config.timeout_s, config.max_retries, config.backoff_s)
                for name, gym in config.gym.items()
            },
        }
        self._metrics = RoundMetrics()

    def __call__(self, prompts: list[Prompt], params: SamplingParams, timers: Timers | None = None) -> list[Trajectory]:
        """`params.num_samples` episodes per prompt, grouped by prompt, in prompt order."""
        timers = timers or Timers()
        groups = [group for group in range(len(prompts)) for _ in range(params.num_samples)]
        with timers.time("generate"), self.server.rollout_session(replace(params, num_samples=1)) as session:
            started = time.monotonic()

            def run(
                indices: list[int],
            ) -> tuple[list[Episode], list[Trajectory], list[str], list[EpisodeTokens | None]]:
                episodes = asyncio.run(self._run_all(session, [prompts[groups[i]].record for i in indices]))
                built = []
                for index, episode in zip(indices, episodes):
                    if episode.result.gym_output is not None:
                        episode.calls = claim_gym_calls(session, episode.result.gym_output)
                    built.append(self._trajectory(groups[index], prompts[groups[index]], episode))
                statuses = [status for _, status, _ in built]
                self._log_errors(episodes, statuses)
                return episodes, [trajectory for trajectory, _, _ in built], statuses, [tokens for *_, tokens in built]

            episodes, trajectories, statuses, joined = run(list(range(len(groups))))

            def rerun(indices: list[int], retry: int) -> list[Trajectory]:  # a new episode (id, session) each
                again, fresh, fresh_statuses, fresh_joined = run(indices)
                for index, episode, status, tokens in zip(indices, again, fresh_statuses, fresh_joined):
                    episodes[index], statuses[index], joined[index] = episode, status, tokens
                return fresh

            trajectories, infra_metrics = settle(trajectories, params.num_samples, rerun, self.infra)
            elapsed = time.monotonic() - started
        unclaimed = session.unclaimed  # counted as the session closed
        contiguous = [tokens.contiguous for tokens in joined if tokens]
        self._metrics.add(
            {
                **self._rollout_metrics(trajectories, episodes, statuses, elapsed),
                **infra_metrics,
                "rollout/agent_contiguous_fraction": sum(contiguous) / len(contiguous) if contiguous else 0.0,
                "rollout/agent_unclaimed_calls": float(unclaimed),
            }
        )
        if "ok" not in statuses:
            first = next((e.result.error for e in episodes if e.result.error), statuses[0])
            raise AgentRolloutError(
                f"none of the rollout's {len(episodes)} agent episodes can be trained on ({statuses[0]}); "
                f"the first: {first}"
            )
        return trajectories

    def _log_errors(self, episodes: list[Episode], statuses: list[str]) -> None:
        failed = [(episode, status) for episode, status in zip(episodes, statuses) if status != "ok"][
            : self.MAX_ERRORS_LOGGED
        ]
        if self.errors_path is None or not failed:
            return
        with self.errors_path.open("a", encoding="utf-8") as handle:
            for episode, status in failed:
                handle.write(
                    json.dumps(
                        {
                            "time": time.time(),
                            "status": status,
                            "error": episode.result.error,
                            "duration_s": round(episode.duration_s, 3),
                        }
                    )
                    + "\n"
                )

    def metrics(self) -> dict[str, float]:
        """The `rollout/agent_*` and `endpoint/*` metrics of the rollouts since the last call (in flight: a prompt
        group's each)."""
        return self._metrics.take()

    async def _run_all(self, session: RolloutSession, records: list[dict[str, Any]]) -> list[Episode]:
        limit = asyncio.Semaphore(self.config.max_concurrency)
        names = {agent_of(record, self.config) for record in records}
        gym = sorted(names & set(self.config.gym))
        async with httpx.AsyncClient(timeout=self.config.timeout_s) as client:
            episodes = asyncio.gather(*(self._run_one(session, record, limit, client) for record in records))
            if not gym or not self.config.first_call_timeout_s:
                return self._check_reached(await episodes, sorted(names))
            watch = asyncio.ensure_future(self._first_call_watch(gym, len(records)))
            try:
                await asyncio.wait({episodes, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch.done() and watch.exception() is not None:
                    episodes.cancel()
                    await asyncio.gather(episodes, return_exceptions=True)  # their cancellation, retrieved
                    raise watch.exception()
                return self._check_reached(await episodes, sorted(names))
            finally:
                watch.cancel()

    def _check_reached(self, episodes: list[Episode], names: list[str]) -> list[Episode]:
        """Episodes that timed out while the endpoint has received no call at all since the run started: the agents'
        calls go elsewhere (a Gym model server on a wrong port), which no retry or restart fixes: a configuration
        error (exit 2), not the agents' timeouts counted as infrastructure. The one place of this check (the
        first-call watch above says it sooner, when it is on and shorter than `agent.timeout_s`)."""
        timed_out = sum(episode.result.status == "timeout" for episode in episodes)
        if not timed_out or self.server.num_received:
            return episodes
        gym = [name for name in names if name in self.config.gym]
        where = (
            f"the Gym model server of agent {', '.join(gym)} (its vllm_model base_url) points elsewhere; set it to "
            f"{self.server.base_url} (agent.endpoint.port fixes the port)"
            if gym
            else f"the agents never called the base_url they were given ({self.server.base_url})"
        )
        raise AgentRolloutError(
            f"{timed_out} of {len(episodes)} episodes timed out (agent.timeout_s={self.config.timeout_s:g}) and the "
            f"policy endpoint at {self.server.base_url} has received no call since the run started: {where}"
        )

    async def _first_call_watch(self, gym: list[str], num_episodes: int) -> None:
        """Gym agents call the endpoint through a model server of their own configuration: when none of their
        episodes has reached it after `agent.first_call_timeout_s`, that server points elsewhere (waiting for
        agent.timeout_s would only say that the episodes did not end)."""
        seen, wait_s = self.server.num_received, self.config.first_call_timeout_s
        await asyncio.sleep(wait_s)
        if self.server.num_received == seen:
            raise AgentRolloutError(
                f"no request reached the policy endpoint within agent.first_call_timeout_s={wait_s:g} of starting "
                f"{num_episodes} episodes of Gym agent {', '.join(gym)}: its model server (Gym's vllm_model) most "
                f"likely points elsewhere; set its base_url to {self.server.base_url} (agent.endpoint.port fixes "
                "the port), or raise agent.first_call_timeout_s for agents that take longer to make their first call"
            )

    async def _run_one(
        self, session: RolloutSession, record: dict[str, Any], limit: asyncio.Semaphore, client: httpx.AsyncClient
    ) -> Episode:
        runner = self.runners[agent_of(record, self.config)]
        sampling = session.sampling
        async with limit:
            started = time.monotonic()
            with self.server.episode(session, keyed=isinstance(runner, PythonAgentRunner)) as episode_id:
                if isinstance(runner, GymAgentRunner):
                    row = stamped_row(record, sampling.temperature, sampling.top_p, sampling.max_new_tokens)
                    try:
                        result = await asyncio.wait_for(runner.run(client, row), self.config.timeout_s)
                    except asyncio.TimeoutError:
                        result = EpisodeResult(
                            "timeout",
                            error=f"Gym agent {runner.name} did not answer within agent.timeout_s",
                            infra_failure="timeout",
                        )
                else:
                    context = {
                        "model": self.server.model_name,
                        "api_key": self.server.token or "none",
                        "servers": dict(self.servers),
                        "sampling": {
                            "temperature": sampling.temperature,
                            "top_p": sampling.top_p,
                            "max_tokens": sampling.max_new_tokens,
                        },
                    }
                    result = await runner.run(self.server.episode_base_url(episode_id), record, context)
            calls = session.recorder.take_episode(episode_id) if episode_id else []
            return Episode(result, calls, time.monotonic() - started)

    def _trajectory(self, group: int, prompt: Prompt, episode: Episode) -> tuple[Trajectory, str, EpisodeTokens | None]:
        result = episode.result
        tokens = join_calls(episode.calls) if episode.calls else None
        status = episode_status(episode, tokens)
        trajectory = Trajectory(
            prompt_ids=list(prompt.token_ids),
            response_ids=[],
            gen_logprobs=[],
            truncated=False,
            reward=result.reward,
            group=group,
            task=prompt.record.get("task") or agent_of(prompt.record, self.config),
            response_mask=[],
            num_turns=0,
            components=dict(result.components),
            masked=status != "ok" or result.mask_sample,
            infra_failure=result.infra_failure,
            infra_error=result.error if result.infra_failure else "",
        )
        if tokens is not None:
            trajectory.prompt_ids, trajectory.response_ids, trajectory.response_mask = (
                tokens.prompt_ids,
                tokens.response_ids,
                tokens.response_mask,
            )
            trajectory.gen_logprobs, trajectory.truncated, trajectory.num_turns = (
                tokens.gen_logprobs,
                tokens.truncated,
                len(episode.calls),
            )
            trajectory.routed_experts, trajectory.token_versions = tokens.routed_experts, tokens.token_versions
            trajectory.images = tokens.images
            trajectory.response_text = self.tokenizer.decode(episode.calls[-1].generation_ids, skip_special_tokens=True)
        return trajectory, status, tokens

    def _rollout_metrics(
        self, trajectories: list[Trajectory], episodes: list[Episode], statuses: list[str], elapsed: float
    ) -> dict[str, float]:
        num = len(trajectories)
        durations = [episode.duration_s for episode in episodes]
        metrics = {
            "rollout/agent_episodes": float(num),
            "rollout/agent_episodes_per_s": num / elapsed if elapsed > 0 else 0.0,
            "rollout/agent_episode_s_mean": sum(durations) / num,
            "rollout/agent_episode_s_max": max(durations),
            "rollout/agent_model_calls_mean": sum(t.num_turns for t in trajectories) / num,
            "rollout/agent_masked_fraction": sum(t.masked for t in trajectories) / num,
            "rollout/agent_mask_sample_fraction": sum(e.result.mask_sample for e in episodes) / num,
        }
        metrics.update({f"rollout/agent_{status}_fraction": statuses.count(status) / num for status in self.STATUSES})
        metrics.update({f"endpoint/{name}": value for name, value in self.server.metrics().items()})
        return metrics


def claim_gym_calls(session: RolloutSession, output: list[dict[str, Any]]) -> list[RecordedCall] | None:
    """The endpoint's records of the model calls a Gym agent reports: the output items that carry
    `generation_token_ids` (Gym puts each call's ids on its last output item), in order; None when one
    of them is not a call this endpoint made (then nothing of the episode is trusted)."""
    calls = []
    for item in output:
        if isinstance(item, dict) and item.get("generation_token_ids"):
            call = session.recorder.claim(list(item.get("prompt_token_ids") or []), list(item["generation_token_ids"]))
            if call is None:
                return None
            calls.append(call)
    return calls
