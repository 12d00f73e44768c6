"""Sampling G answers per prompt as unscored trajectories (the first turn of every rollout)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from reinforge.data.batch import Trajectory
from reinforge.data.prompts import Prompt
from reinforge.generation.base import GenerationBackend, SamplingParams


def generate_trajectories(
    prompts: list[Prompt],
    engine: GenerationBackend,
    params: SamplingParams,
    tokenizer: PreTrainedTokenizerBase,
) -> list[Trajectory]:
    """`params.num_samples` unscored trajectories per prompt, grouped by prompt, in prompt order; with
    `params.record_routes`, each with the engine's routes of its tokens (the last one's excepted)."""
    images = [p.images for p in prompts]
    if any(i is not None for i in images):  # a vision-language model's image prompts
        result = engine.generate([p.token_ids for p in prompts], params, images=images)
    else:
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
                    routed_experts=completion.routed_experts,  # with params.record_routes (router replay)
                    token_versions=completion.token_versions,  # when the engine says (in-flight generation)
                    images=prompt.images,
                )
            )
    return trajectories
