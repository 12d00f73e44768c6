"""Single-turn rollouts: sample G answers per prompt, then let each record's environment score them."""

from __future__ import annotations

from collections import defaultdict

from transformers import PreTrainedTokenizerBase

from reinforge.data.batch import Trajectory
from reinforge.data.prompts import Prompt
from reinforge.envs.base import EnvRequest, Environment
from reinforge.errors import DataError
from reinforge.generation.base import GenerationBackend, SamplingParams


def generate_trajectories(
    prompts: list[Prompt],
    engine: GenerationBackend,
    params: SamplingParams,
    tokenizer: PreTrainedTokenizerBase,
) -> list[Trajectory]:
    """`params.num_samples` unscored trajectories per prompt, grouped by prompt, in prompt order."""
    result = engine.generate([p.token_ids for p in prompts], params)
    trajectories = []
    for group, (prompt, completions) in enumerate(zip(prompts, result.completions)):
        for completion in completions:
            trajectories.append(
                Trajectory(
                    prompt_ids=prompt.token_ids,
                    response_ids=completion.token_ids,
                    gen_logprobs=completion.logprobs,
                    truncated=completion.finish_reason == "length",
                    reward=0.0,
                    group=group,
                    task="",
                    response_text=tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                )
            )
    return trajectories


def score_trajectories(
    trajectories: list[Trajectory], prompts: list[Prompt], envs: dict[str, Environment], default_task: str
) -> None:
    """Fill in each trajectory's task and reward; one `step` call per environment."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for index, trajectory in enumerate(trajectories):
        task = prompts[trajectory.group].record.get("task", default_task)
        if task not in envs:
            raise DataError(f"record task {task!r} has no environment; known tasks: {', '.join(sorted(envs))}")
        trajectory.task = task
        by_task[task].append(index)
    for task, indices in by_task.items():
        requests = [
            EnvRequest(
                messages=prompts[trajectories[i].group].messages
                + [{"role": "assistant", "content": trajectories[i].response_text}],
                record=prompts[trajectories[i].group].record,
            )
            for i in indices
        ]
        for i, response in zip(indices, envs[task].step(requests)):
            trajectories[i].reward = response.reward
