"""On-policy distillation against GRPO from the same start (models/demo) on the same prompts, the same steps.

    python bench/distill_vs_grpo.py --steps 50 --json bench/results/distill_vs_grpo.json

Two runs, one after the other in this invocation, each a `reinforge` subprocess with the same seed, batch sizes,
engine and validation set (data/demo/val.jsonl, greedy): `reinforge grpo --config configs/grpo_demo.yaml` and
`reinforge distill --config configs/distill_demo.yaml` (teacher models/demo_teacher, scripts/build_demo_teacher.py; the
top-k KL), the same with `distill.loss=reverse_kl` (the sampled-token reverse KL as advantage), validating every
`--val-every` steps. Reported: both validation curves, the accuracy GRPO ends at, the first
step at which each run reaches it, the teacher's own greedy accuracy, and each run's wall and loop time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import run_cli, write_result  # noqa: E402

RUNS = {
    "grpo": ["grpo", "--config", str(ROOT / "configs" / "grpo_demo.yaml")],
    "distill": ["distill", "--config", str(ROOT / "configs" / "distill_demo.yaml")],  # the top-k KL (forward, k = 64)
    "distill_reverse_kl": [
        "distill",
        "--config",
        str(ROOT / "configs" / "distill_demo.yaml"),
        "distill.loss=reverse_kl",
    ],
}


def curve(arguments: list[str], steps: int, val_every: int, num_threads: int) -> dict:
    rows, wall = run_cli([*arguments, f"cluster.num_threads={num_threads}"], steps, val_every)
    return {
        "val_accuracy": {row["step"]: row["val/accuracy"] for row in rows if "val/accuracy" in row},
        "train_reward_mean": {row["step"]: row["train/reward_mean"] for row in rows if "train/reward_mean" in row},
        "wall_s": wall,
        "loop_s": sum(row["timing/step_s"] for row in rows if row["step"] > 0),
    }


def first_step_reaching(accuracies: dict[int, float], target: float) -> int | None:
    return next((step for step, accuracy in sorted(accuracies.items()) if accuracy >= target), None)


def teacher_accuracy(num_threads: int) -> float:
    """The teacher's greedy validation accuracy: a zero-step GRPO run from models/demo_teacher."""
    arguments = [*RUNS["grpo"], "model.name_or_path=models/demo_teacher", f"cluster.num_threads={num_threads}"]
    rows, _ = run_cli(arguments, steps=0, val_every=5)
    return rows[0]["val/accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "distill_vs_grpo.json")
    args = parser.parse_args()
    results = {}
    for name, arguments in RUNS.items():
        results[name] = curve(arguments, args.steps, args.val_every, args.num_threads)
        print(name, json.dumps(results[name]["val_accuracy"]), flush=True)
    target = results["grpo"]["val_accuracy"][args.steps]
    out = {
        "steps": args.steps,
        "val_every": args.val_every,
        "num_threads": args.num_threads,
        "machine": f"{os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "teacher_val_accuracy": teacher_accuracy(args.num_threads),
        "grpo_final_val_accuracy": target,
        "first_step_reaching_grpo_final": {
            name: first_step_reaching(r["val_accuracy"], target) for name, r in results.items()
        },
        "runs": results,
    }
    write_result(args.json, out)
    print(
        f"GRPO ends at {target:.3f} after {args.steps} steps; "
        f"first step reaching it: {out['first_step_reaching_grpo_final']}; "
        f"teacher {out['teacher_val_accuracy']:.3f} -> {args.json}"
    )


if __name__ == "__main__":
    main()
