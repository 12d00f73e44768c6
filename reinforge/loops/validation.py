"""The RL loop's validation: the greedy accuracy of the policy in the engine on the held-out prompts, with the
environments' and the agents' counters of those episodes, and the scores of `loop.val_benchmarks`."""

from __future__ import annotations

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.algorithms.step_metrics import env_metrics, per_task_means, scored_tasks
from reinforge.data.prompts import Prompt
from reinforge.envs.base import Environment
from reinforge.evaluation.evaluate import ValidationBenchmark, benchmark_metrics
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.rollout.rollout import Episodes


def validate(
    config: RLRunConfig,
    prompts: list[Prompt],
    episodes: Episodes,
    engine: GenerationBackend,
    tokenizer,
    envs: dict[str, Environment],
    benchmarks: list[ValidationBenchmark] = (),
) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts (the mean reward of one greedy answer per prompt), and the
    `loop.val_benchmarks` scores."""
    gen = config.generation
    benchmark_scores = {}
    if benchmarks:
        benchmark_scores = benchmark_metrics(
            list(benchmarks), engine, tokenizer, envs, config.loop.val_benchmark_k, gen.max_new_tokens, config.seed
        )
    params = SamplingParams(
        max_new_tokens=gen.max_new_tokens, temperature=0.0, num_samples=1, stop_strings=tuple(gen.stop_strings)
    )
    trajectories = [t for t in episodes(prompts, params) if not t.excluded]  # no verdict: infra failures
    scored = scored_tasks({t.task for t in trajectories}, config.rollout.driver, config.env.extra_rewards)
    scored |= {item.record["task"] for benchmark in benchmarks for item in benchmark.items}
    agent_counters = {
        f"val/{name.split('/', 1)[1]}": value
        for name, value in episodes.metrics().items()
        if name.startswith(("rollout/agent_", "rollout/infra_"))
    }
    return {
        **{f"val/{name}": value for name, value in env_metrics(envs, scored).items()},  # the validation's own
        **agent_counters,
        "val/accuracy": sum(t.reward for t in trajectories) / len(trajectories),
        "val/gen_len_mean": sum(len(t.response_ids) for t in trajectories) / len(trajectories),
        **per_task_means(trajectories, "val", "accuracy"),
        **benchmark_scores,
    }
