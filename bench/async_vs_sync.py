"""Async GRPO (rollout.max_staleness=1) against synchronous GRPO, the same steps: against the plain
in-process run, and against max_staleness=0 on the same placement (engine in a Ray actor, trainer on
one thread), where the only difference is generating ahead.

    python bench/async_vs_sync.py --steps 20 --json bench/results/async_vs_sync.json

Each setting is one `reinforge grpo --config configs/grpo_demo.yaml` run as a subprocess, with the
same seed; the runs alternate (sync, async, sync, async, ...) for `--repeats` rounds so that load from
other jobs hits both alike. Reported per setting: the process's wall time (start-up included), the sum
of `timing/step_s` over the steps (the training loop alone: generation the trainer waited for, logprobs,
training, refit), the median step time, the mean training reward over the last 5 steps and the final
validation accuracy. Both settings use the whole machine: synchronous with torch's default threads
(all cores) in one process; async with the trainer on one thread and the engine in a Ray actor with
one CPU of its own (configs/grpo_async_demo.yaml), with max_staleness 0 (generation waits for each refit)
or 1. In-flight generation (`rollout.mode=in_flight`, the engine in the driver process, refits between decoding
steps) runs beside them; `trained_tokens_per_s` is the tokens trained on over the loop's time, and in-flight runs
report the engine's idle fraction. `--engine vllm` runs every setting with vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import run_cli, write_result  # noqa: E402

ASYNC = ["--config", str(ROOT / "configs" / "grpo_async_demo.yaml")]
SETTINGS = {
    "sync, in-process": ["--config", str(ROOT / "configs" / "grpo_demo.yaml")],
    "async, max_staleness=0": ASYNC + ["rollout.max_staleness=0"],  # the same placement, generation not ahead
    "async, max_staleness=1": ASYNC,
    "in_flight": ["--config", str(ROOT / "configs" / "grpo_demo.yaml"), "rollout.mode=in_flight"],
}


def run(arguments: list[str], steps: int, engine: str) -> dict:
    rows, wall = run_cli(["grpo", *arguments, f"generation.backend={engine}"], steps, val_every=steps)
    steps_rows = [r for r in rows if r["step"] > 0]
    loop_s = sum(r["timing/step_s"] for r in steps_rows)
    idle = [r["generation/idle_fraction"] for r in steps_rows if "generation/idle_fraction" in r]
    return {
        "wall_s": wall,
        "loop_s": loop_s,
        "median_step_s": statistics.median(r["timing/step_s"] for r in steps_rows),
        "trained_tokens_per_s": sum(r["perf/tokens_per_s"] * r["timing/step_s"] for r in steps_rows) / loop_s,
        "reward_last5": statistics.mean(r["train/reward_mean"] for r in steps_rows[-5:]),
        "val_accuracy": steps_rows[-1].get("val/accuracy"),
        "policy_lag_mean": statistics.mean(r["rollout/policy_lag"] for r in steps_rows),
        "engine_idle_fraction": statistics.mean(idle) if idle else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "async_vs_sync.json")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, arguments in SETTINGS.items():
            results[name].append(run(arguments, args.steps, args.engine))
            print(name, json.dumps(results[name][-1]), flush=True)
    summary = {
        name: {key: None if runs[0][key] is None else statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    sync, same_placement, asynchronous, in_flight = (summary[name] for name in SETTINGS)
    out = {
        "steps": args.steps,
        "engine": args.engine,
        "repeats": args.repeats,
        "machine": f"{os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": summary,
        "runs": results,
        "loop_speedup": sync["loop_s"] / asynchronous["loop_s"],
        "wall_speedup": sync["wall_s"] / asynchronous["wall_s"],
        "loop_speedup_same_placement": same_placement["loop_s"] / asynchronous["loop_s"],
        "wall_speedup_same_placement": same_placement["wall_s"] / asynchronous["wall_s"],
        "in_flight_tokens_vs_sync": in_flight["trained_tokens_per_s"] / sync["trained_tokens_per_s"],
        "in_flight_tokens_vs_async": in_flight["trained_tokens_per_s"] / asynchronous["trained_tokens_per_s"],
    }
    write_result(args.json, out)
    for name, values in summary.items():
        print(f"{name:26s} " + "  ".join(f"{k}={v:.3f}" for k, v in values.items() if v is not None))
    print(
        f"max_staleness=1 against in-process sync: loop {out['loop_speedup']:.2f}x, wall {out['wall_speedup']:.2f}x; "
        f"against max_staleness=0 on the same placement: loop {out['loop_speedup_same_placement']:.2f}x, "
        f"wall {out['wall_speedup_same_placement']:.2f}x; in-flight trained tokens/s: "
        f"{out['in_flight_tokens_vs_sync']:.2f}x sync, {out['in_flight_tokens_vs_async']:.2f}x async -> {args.json}"
    )


if __name__ == "__main__":
    main()
