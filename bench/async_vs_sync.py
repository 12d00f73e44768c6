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
or 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ["--config", str(ROOT / "configs" / "grpo_async_demo.yaml")]
SETTINGS = {
    "sync, in-process": ["--config", str(ROOT / "configs" / "grpo_demo.yaml")],
    "async, max_staleness=0": ASYNC + ["rollout.max_staleness=0"],  # the same placement, generation not ahead
    "async, max_staleness=1": ASYNC,
}


def run(arguments: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "reinforge.cli",
            "grpo",
            *arguments,
            f"loop.max_steps={steps}",
            f"loop.val_every={steps}",
            f"logging.run_dir={tmp}/run",
            "checkpoint.save_final=false",
        ]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] > 0]
    return {
        "wall_s": wall,
        "loop_s": sum(r["timing/step_s"] for r in steps_rows),
        "median_step_s": statistics.median(r["timing/step_s"] for r in steps_rows),
        "reward_last5": statistics.mean(r["train/reward_mean"] for r in steps_rows[-5:]),
        "val_accuracy": steps_rows[-1].get("val/accuracy"),
        "policy_lag_mean": statistics.mean(r["rollout/policy_lag"] for r in steps_rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "async_vs_sync.json")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, arguments in SETTINGS.items():
            results[name].append(run(arguments, args.steps))
            print(name, json.dumps(results[name][-1]), flush=True)
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()
    }
    sync, same_placement, asynchronous = (summary[name] for name in SETTINGS)
    out = {
        "steps": args.steps,
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
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    for name, values in summary.items():
        print(f"{name:26s} " + "  ".join(f"{k}={v:.3f}" for k, v in values.items() if v is not None))
    print(
        f"max_staleness=1 against in-process sync: loop {out['loop_speedup']:.2f}x, wall {out['wall_speedup']:.2f}x; "
        f"against max_staleness=0 on the same placement: loop {out['loop_speedup_same_placement']:.2f}x, "
        f"wall {out['wall_speedup_same_placement']:.2f}x -> {args.json}"
    )


if __name__ == "__main__":
    main()
