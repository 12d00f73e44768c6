"""GRPO step time of the demo config with 1 vs 2 FSDP2 training workers, colocated vs split placement.

    python bench/distributed_step_time.py --steps 5 --json OUT.json

Each setting is a separate `reinforge grpo` run (HF engines as a Ray worker group); the median of
`timing/step_s` over the steps after the first (which pays for warm-up) is reported with its phases.
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
SETTINGS = {
    "torch, 1 process": ["training.backend=torch"],
    "fsdp2 x1, colocated": ["training.backend=fsdp2", "training.num_workers=1", "cluster.colocate=true"],
    "fsdp2 x2, colocated": ["training.backend=fsdp2", "training.num_workers=2", "cluster.colocate=true"],
    "fsdp2 x2, split": ["training.backend=fsdp2", "training.num_workers=2", "cluster.colocate=false"],
}
PHASES = ["timing/step_s", "timing/generate_s", "timing/logprobs_s", "timing/train_s", "timing/refit_s"]


def run(overrides: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "reinforge.cli",
            "grpo",
            "--config",
            str(ROOT / "configs" / "grpo_demo.yaml"),
            f"loop.max_steps={steps}",
            "loop.val_every=0",
            "data.max_val_prompts=1",
            f"logging.run_dir={tmp}/run",
            *overrides,
        ]
        subprocess.run(command, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()][2:]
    return {phase: statistics.median(r[phase] for r in rows) for phase in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "steps": args.steps, "settings": {}}
    for name, overrides in SETTINGS.items():
        results["settings"][name] = run(overrides, args.steps)
        print(
            name, json.dumps({k.split("/")[1]: round(v, 3) for k, v in results["settings"][name].items()}), flush=True
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
