"""Does the demo learn as well in flight as synchronously? Final validation accuracy after the same steps, over
several seeds.

    python bench/in_flight_parity.py --steps 50 --seeds 0 1 2

Each (seed, mode) is one `reinforge grpo --config configs/grpo_demo.yaml seed=SEED` run as a subprocess: `sync`
as configured, `in_flight` with `rollout.mode=in_flight` and the trainer on one thread (the engine in a Ray actor
with a CPU of its own), the default `rollout.max_staleness=1`. Validation (greedy, data/demo/val.jsonl's first
`data.max_val_prompts`) at the start and at the end. Reported: each run's final accuracy, the per-seed
difference, and the mean difference with its standard error. Results: bench/results/in_flight_parity.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import run_cli, write_result  # noqa: E402

CONFIG = ["--config", str(ROOT / "configs" / "grpo_demo.yaml")]
MODES = {"sync": [], "in_flight": ["rollout.mode=in_flight", "cluster.num_threads=1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "in_flight_parity.json")
    args = parser.parse_args()
    runs: dict[str, dict[int, dict]] = {mode: {} for mode in MODES}
    for seed in args.seeds:
        for mode, extra in MODES.items():
            arguments = ["grpo", *CONFIG, *extra, f"seed={seed}", f"generation.backend={args.engine}"]
            rows, wall = run_cli(arguments, args.steps, val_every=args.steps)
            accuracies = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
            runs[mode][seed] = {"val_accuracy_start": accuracies[0], "val_accuracy": accuracies[-1], "wall_s": wall}
            print(seed, mode, runs[mode][seed], flush=True)
    differences = [runs["in_flight"][s]["val_accuracy"] - runs["sync"][s]["val_accuracy"] for s in args.seeds]
    sem = statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else None
    out = {
        "steps": args.steps,
        "engine": args.engine,
        "seeds": args.seeds,
        "machine": f"{os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "mean_val_accuracy": {mode: statistics.mean(r["val_accuracy"] for r in runs[mode].values()) for mode in MODES},
        "difference_per_seed": differences,
        "mean_difference": statistics.mean(differences),
        "mean_difference_sem": sem,
    }
    write_result(args.json, out)
    print(
        f"val accuracy after {args.steps} steps: sync {out['mean_val_accuracy']['sync']:.3f}, in-flight "
        f"{out['mean_val_accuracy']['in_flight']:.3f}; in-flight - sync {out['mean_difference']:+.3f} per seed "
        f"{[round(d, 3) for d in differences]} -> {args.json}"
    )


if __name__ == "__main__":
    main()
