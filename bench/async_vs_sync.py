"""Synchronous, async and in-flight GRPO, the same steps, on two workloads: trained tokens per second, the engine's
idle fraction, the final validation accuracy, and where each step's time goes.

    python bench/async_vs_sync.py --workload longtail --engine vllm --steps 30
    python bench/async_vs_sync.py --workload demo --steps 20
    python bench/async_vs_sync.py --workload longtail --model 30m --engine vllm --steps 15
    python bench/async_vs_sync.py --workload longtail --steps 8 --skip "in_flight, version_check" \
        --set generation.max_new_tokens=512 data.max_val_prompts=50   # the HF engine, shortened
    python bench/async_vs_sync.py --workload longtail --model 30m --steps 5 --skip "in_flight, version_check" \
        --set generation.max_new_tokens=256 data.max_val_prompts=50   # the 30M model on the HF engine, shortened

Each setting is one `reinforge grpo` run as a subprocess, with the same seed; the settings alternate for `--repeats`
rounds so that load from other jobs hits them alike. Reported per setting: the process's wall time (start-up
included), the sum of `timing/step_s` over the steps (the training loop alone), the median step time,
`trained_tokens_per_s` (tokens trained on over the loop's time), the mean training reward over the last 5 steps,
the final validation accuracy, the engine's idle fraction (in flight), token staleness, the largest
train/inference mismatch over all tokens and, with `rollout.version_check`, over each token against the version
that sampled it, and the mean of every `timing/*` per step. Every setting uses the whole machine: synchronous with
torch's default threads (all cores) in one process; async and in-flight with the trainer on one thread and the
engine in a Ray actor with one CPU of its own.

- `--workload demo` (configs/grpo_demo.yaml; answers of ~33 tokens): sync, async with max_staleness 0 (the
  async placement, generation not ahead) and 1, in-flight.
- `--workload longtail` (configs/grpo_longtail_demo.yaml, whose policy the SFT stage configs/longtail_sft_demo.yaml
  makes first, ~2 minutes, when runs/longtail_sft_demo/final is missing): a tenth of the answers 10-40x longer, as
  a reasoning model's. Sync, async (max_staleness 1, configs/grpo_async_demo.yaml's), in-flight (max_staleness 8:
  a long answer spans many updates; 48 prompts in flight), and in-flight with `rollout.version_check`.
- `--model 30m` (long tail only): the same on a ~30M Qwen2: models/demo grown to that shape, computing the demo's
  function (bench/_common.py's grow_demo_model), then the SFT stage for 150 steps from it at the learning rate
  scaled by the widths' ratio (~20 minutes, into runs/longtail_sft_30m), 8 prompts a step, 12 in flight.

`--engine vllm` runs every setting with vLLM. Results: bench/results/async_vs_sync[_longtail][_30m][_vllm].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import run_cli, write_result  # noqa: E402

CONFIGS = ROOT / "configs"
# The long-tail policy of each model: the SFT stage's output (configs/longtail_sft_demo.yaml, from models/demo; for
# the 30M model from models/demo grown to ~30M parameters, bench/_common.py's grow_demo_model)
LONGTAIL_SFT = {"demo": ROOT / "runs" / "longtail_sft_demo", "30m": ROOT / "runs" / "longtail_sft_30m"}
ASYNC = ["--config", str(CONFIGS / "grpo_async_demo.yaml")]
LONGTAIL = ["--config", str(CONFIGS / "grpo_longtail_demo.yaml")]
# The 30M model's GRPO steps are a quarter of the demo's (8 prompts x 8 answers, two optimizer steps), so that
# a step takes seconds on 2 cores, with 12 prompts in flight (the demo's 1.5 x the step's prompts); its learning
# rate is the demo's times the widths' ratio, as for its SFT stage (at the demo's 1e-4 its reward fell from 0.45 to
# 0.02 in 14 steps, the KL to the reference at 0.5-0.8)
MODEL_SETTINGS = {
    "demo": [],
    "30m": [
        "optimizer.lr=2.5e-5",
        "rollout.num_prompts_per_step=8",
        "training.global_batch_size=32",
        "training.micro_batch_size=32",
        "data.max_val_prompts=100",
    ],
}
POOL = {"demo": 48, "30m": 12}
# Async and in-flight runs: the trainer on one thread, each engine in a Ray actor with one CPU of its own.
IN_FLIGHT = ["rollout.mode=in_flight", "cluster.num_threads=1"]
WORKLOADS = {
    "demo": {
        "sync": ["--config", str(CONFIGS / "grpo_demo.yaml")],
        "async, max_staleness=0": ASYNC + ["rollout.max_staleness=0"],  # the same placement, not ahead
        "async": ASYNC,
        "in_flight": ["--config", str(CONFIGS / "grpo_demo.yaml"), *IN_FLIGHT],
    },
    # A tenth of the answers ~10-40x longer: in flight, a long answer spans many updates, so its oldest token may
    # be 8 versions old (with 1, the long ones would be generated again and again), and 48 prompts are in flight.
    "longtail": {
        "sync": LONGTAIL,
        "async": LONGTAIL + ["rollout.mode=async", "rollout.max_staleness=1", "cluster.num_threads=1"],
        "in_flight": LONGTAIL + [*IN_FLIGHT, "rollout.max_staleness=8"],
        "in_flight, version_check": LONGTAIL + [*IN_FLIGHT, "rollout.max_staleness=8", "rollout.version_check=true"],
    },
}


def run(arguments: list[str], steps: int, engine: str) -> dict:
    rows, wall = run_cli(["grpo", *arguments, f"generation.backend={engine}"], steps, val_every=steps)
    steps_rows = [r for r in rows if r["step"] > 0]
    loop_s = sum(r["timing/step_s"] for r in steps_rows)

    def mean(key: str) -> float | None:
        values = [r[key] for r in steps_rows if key in r]
        return statistics.mean(values) if values else None

    def largest(key: str) -> float | None:
        values = [r[key] for r in steps_rows if key in r]
        return max(values) if values else None

    timings = sorted({key for r in steps_rows for key in r if key.startswith("timing/")})
    return {
        "wall_s": wall,
        "loop_s": loop_s,
        "median_step_s": statistics.median(r["timing/step_s"] for r in steps_rows),
        "trained_tokens_per_s": sum(r["perf/tokens_per_s"] * r["timing/step_s"] for r in steps_rows) / loop_s,
        "reward_last5": statistics.mean(r["train/reward_mean"] for r in steps_rows[-5:]),
        "val_accuracy_start": next((r["val/accuracy"] for r in rows if r["step"] == 0 and "val/accuracy" in r), None),
        "val_accuracy": steps_rows[-1].get("val/accuracy"),
        "policy_lag_mean": mean("rollout/policy_lag"),
        "engine_idle_fraction": mean("generation/idle_fraction"),
        "response_length_max": largest("rollout/gen_len_max"),
        "token_staleness_max": largest("rollout/token_staleness_max"),
        "spanning_update_fraction": mean("rollout/spanning_update_fraction"),
        "regenerated": sum(r.get("rollout/in_flight_regenerated", 0) for r in steps_rows),
        "token_mult_prob_error_max": largest("train/token_mult_prob_error"),
        "version_matched_error_max": largest("train/version_matched/token_mult_prob_error"),
        "version_matched_share_min": min(
            (r["train/version_matched/token_share"] for r in steps_rows if "train/version_matched/token_share" in r),
            default=None,
        ),
        "time_per_step": {key: mean(key) for key in timings},  # where the time goes (means over the steps)
    }


def longtail_model(model: str) -> Path:
    """The long-tail workload's policy for `model` (stage 1, configs/longtail_sft_demo.yaml), made when it is not
    there yet."""
    run_dir = LONGTAIL_SFT[model]
    if (run_dir / "final" / "config.json").exists():
        return run_dir / "final"
    command = [sys.executable, "-m", "reinforge.cli", "sft", "--config", str(CONFIGS / "longtail_sft_demo.yaml")]
    command.append(f"logging.run_dir={run_dir}")
    if model == "30m":
        from _common import grow_demo_model

        start = grow_demo_model(ROOT / "runs" / "qwen2-30m-grown")
        # the learning rate times 128 / 512 (the widths' ratio, as muP scales it): at the demo's 1e-3 a 4x wider
        # matrix moves the function 4x as far per step
        command += [f"model.name_or_path={start}", "optimizer.lr=2.5e-4", "sft.max_steps=150", "sft.val_every=50"]
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        raise SystemExit("the long-tail SFT stage (configs/longtail_sft_demo.yaml) failed")
    return run_dir / "final"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--workload", default="demo", choices=tuple(WORKLOADS))
    parser.add_argument("--model", default="demo", choices=tuple(MODEL_SETTINGS), help="30m: long tail only")
    parser.add_argument("--json", type=Path, help="default: bench/results/async_vs_sync[_longtail][_30m][_vllm].json")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every setting (key=value)")
    parser.add_argument("--skip", nargs="*", default=[], help="settings left out (not sync, async or in_flight)")
    args = parser.parse_args()
    parts = (args.workload, args.model, args.engine)
    suffix = "".join(f"_{part}" for part in parts if part not in ("demo", "hf"))
    args.json = args.json or ROOT / "bench" / "results" / f"async_vs_sync{suffix}.json"
    settings = WORKLOADS[args.workload]
    if args.workload == "longtail":
        policy = [f"model.name_or_path={longtail_model(args.model)}", *MODEL_SETTINGS[args.model]]
        pool = f"rollout.in_flight_pool_groups={POOL[args.model]}"
        settings = {
            name: [*arguments, *policy] + ([pool] if "in_flight" in name else [])
            for name, arguments in settings.items()
        }
    elif args.model != "demo":
        raise SystemExit("--model 30m runs the long-tail workload: add --workload longtail")
    optional = sorted(set(settings) - {"sync", "async", "in_flight"})  # the speed-ups compare those three
    if not set(args.skip) <= set(optional):
        raise SystemExit(f"--skip {args.skip}: only these settings can be left out: {optional}")
    settings = {name: [*arguments, *args.set] for name, arguments in settings.items() if name not in args.skip}
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, arguments in settings.items():
            results[name].append(run(arguments, args.steps, args.engine))
            print(name, json.dumps(results[name][-1]), flush=True)
    summary = {name: _median(runs) for name, runs in results.items()}
    sync, asynchronous, in_flight = (summary[name] for name in ("sync", "async", "in_flight"))
    out = {
        "steps": args.steps,
        "workload": args.workload,
        "model": args.model,
        "engine": args.engine,
        "repeats": args.repeats,
        "overrides": args.set,
        "machine": f"{os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": summary,
        "runs": results,
        "async_loop_speedup": sync["loop_s"] / asynchronous["loop_s"],
        "async_tokens_vs_sync": asynchronous["trained_tokens_per_s"] / sync["trained_tokens_per_s"],
        "in_flight_tokens_vs_sync": in_flight["trained_tokens_per_s"] / sync["trained_tokens_per_s"],
        "in_flight_tokens_vs_async": in_flight["trained_tokens_per_s"] / asynchronous["trained_tokens_per_s"],
    }
    write_result(args.json, out)
    for name, values in summary.items():
        print(f"{name:26s} " + "  ".join(f"{k}={v:.3f}" for k, v in values.items() if isinstance(v, float)))
    print(
        f"trained tokens/s: async {out['async_tokens_vs_sync']:.2f}x sync; in-flight "
        f"{out['in_flight_tokens_vs_sync']:.2f}x sync, {out['in_flight_tokens_vs_async']:.2f}x async, "
        f"engine idle {in_flight['engine_idle_fraction']:.3f} -> {args.json}"
    )


def _median(runs: list[dict]) -> dict:
    """Each number's median over the repeats (the first run's where it is not a number)."""
    return {
        key: statistics.median(r[key] for r in runs) if isinstance(value, (int, float)) else value
        for key, value in runs[0].items()
    }


if __name__ == "__main__":
    main()
