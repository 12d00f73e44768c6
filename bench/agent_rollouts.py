"""Agent rollouts through the endpoint against reinforge's in-process rollout of the same prompts.

    python bench/agent_rollouts.py --json bench/results/agent_rollouts.json

The tool demo model (models/tool_demo) on 8 validation prompts x 8 samples = 64 concurrent episodes,
each up to 3 policy turns, at temperature 1, on the same HF engine in this process:
- in-process: reinforge drives the episodes (rollout/rollout.py) with the `tool_use` environment
  (calculator) in this process: token ids straight to the engine, tool results appended as tokens;
- agent: reinforge's Python simple agent (reinforge/agents/simple.py), one per episode, calls the
  policy through the run's OpenAI-compatible endpoint with the `openai` client and the calculator on
  the same environment served as a NeMo Gym resources server (HTTP on loopback); the trajectories are
  rebuilt from the endpoint's record, as in `rollout.driver=agent`.
The settings alternate for `--repeats` rounds. Reported per setting: episodes per second (best and
median), the time in the engine, and, for the agent path, where the rest goes: HTTP and the agents
(everything but the engine), the number of engine calls and their mean batch size, model calls per
episode. Both settings make the same number of engine calls per turn when batching works.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-wait-s", type=float, default=None, help="agent.endpoint.batch_wait_s (default: its default)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (this process runs the engine, the endpoint and the agents)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from reinforge.data.prompts import DataConfig, load_prompts
    from reinforge.envs.registry import EnvConfig, build_env
    from reinforge.generation.base import SamplingParams
    from reinforge.generation.hf import HFGenerationBackend
    from reinforge.logging.metrics import Timers
    from reinforge.loops.builders import serve_gym_envs
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import load_model, load_tokenizer
    from reinforge.rollout.agent import AgentRollout
    from reinforge.rollout.agent_config import AgentConfig
    from reinforge.rollout.rollout import ReinforgeRollout, RolloutOptions
    from reinforge.serving.app import build_app
    from reinforge.serving.server import PolicyServer

    model_config = ModelConfig(name_or_path="models/tool_demo")
    tokenizer = load_tokenizer(model_config)
    engine = HFGenerationBackend(load_model(model_config), tokenizer, max_batch_size=256)
    prompts = load_prompts("data/tool_demo/val.jsonl", DataConfig(), tokenizer)[: args.prompts]
    env_config = EnvConfig(tool_use={"tools": ["calculator"]})
    params = SamplingParams(max_new_tokens=48, temperature=1.0, num_samples=args.samples)
    results: dict[str, list[dict]] = {"in-process": [], "agent": []}
    with ExitStack() as cleanup:
        in_process = ReinforgeRollout(
            engine,
            tokenizer,
            {"tool_use": build_env("tool_use", env_config)},
            RolloutOptions(default_task="tool_use", max_turns=3),
        )
        endpoint = {} if args.batch_wait_s is None else {"batch_wait_s": args.batch_wait_s}
        agent_config = AgentConfig(
            python={"simple": "reinforge.agents.simple:run"},
            max_concurrency=args.prompts * args.samples,
            endpoint=endpoint,
        )
        server = PolicyServer(
            engine, tokenizer, agent_config.endpoint, max_model_len=512, default_max_tokens=48, managed=True
        )
        server.start(build_app(server))
        cleanup.callback(server.stop)
        servers = serve_gym_envs({"calculator": "tool_use"}, env_config, cleanup)
        agents = AgentRollout(server, tokenizer, agent_config, servers)
        for repeat in range(args.repeats + 1):  # the first round warms up and is not kept
            for name, episodes in (("in-process", in_process), ("agent", agents)):
                timers = Timers()
                started = time.perf_counter()
                trajectories = episodes(prompts, replace(params, seed=repeat), timers)
                elapsed = time.perf_counter() - started
                metrics = episodes.metrics()
                engine_s = metrics.get("endpoint/engine_s", timers.seconds.get("generate", 0.0))
                row = {
                    "episodes_per_s": len(trajectories) / elapsed,
                    "elapsed_s": elapsed,
                    "engine_s": engine_s,
                    "not_engine_s": elapsed - engine_s,
                    "turns_mean": sum(t.num_turns for t in trajectories) / len(trajectories),
                    "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
                }
                if name == "agent":
                    row.update(
                        engine_calls=metrics["endpoint/engine_calls"],
                        mean_batch=metrics["endpoint/mean_batch_sequences"],
                        requests=metrics["endpoint/requests"],
                        ok_fraction=metrics["rollout/agent_ok_fraction"],
                        contiguous_fraction=metrics["rollout/agent_contiguous_fraction"],
                    )
                else:
                    row["reward_s"] = timers.seconds.get("reward", 0.0)
                if repeat:
                    results[name].append(row)
                print(f"{name:10s} round {repeat}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    summary = {}
    for name, rows in results.items():
        summary[name] = {
            "episodes_per_s_best": max(r["episodes_per_s"] for r in rows),
            "episodes_per_s_median": statistics.median(r["episodes_per_s"] for r in rows),
            "engine_s_median": statistics.median(r["engine_s"] for r in rows),
            "not_engine_s_median": statistics.median(r["not_engine_s"] for r in rows),
            "turns_mean": statistics.mean(r["turns_mean"] for r in rows),
        }
    summary["agent_over_in_process"] = (
        summary["agent"]["episodes_per_s_median"] / summary["in-process"]["episodes_per_s_median"]
    )
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": "python bench/agent_rollouts.py",
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "machine": platform.platform(),
                    "date": time.strftime("%Y-%m-%d"),
                    "summary": summary,
                    "rounds": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
