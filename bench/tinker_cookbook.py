"""tinker-cookbook's own sl_loop and rl_loop, unchanged, against a reinforge Tinker server on this machine (the issue's
claim: sl_loop lowers the demo's SFT loss, rl_loop raises the demo's reward by at least 0.15 within 15 minutes).

    python bench/tinker_cookbook.py --json bench/results/tinker_cookbook.json

One server (configs/tinker_cookbook.yaml: models/tinker_demo under the name the cookbook knows, the torch backend, the
HF engine) in this process; each recipe in a process of its own through scripts/run_tinker_cookbook.py, which only
puts the demo's data where the recipe's `load_dataset` looks and the demo tokenizer in the cookbook's registry. The
recipes' own fields size the runs for a CPU (the defaults ask for 128 problems x 16 samples of 256 tokens a step).
Reported: each step's train_mean_nll (sl_loop) and reward/total (rl_loop) with their step times, each run's wall
time, and the claim: sl_loop's loss over its last 5 steps below its first step's; rl_loop's reward over its last 5
steps at least 0.15 above its first step's (sampled before any update), within 15 minutes of wall time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "scripts")]
from _common import write_result  # noqa: E402
from run_tinker_cookbook import cookbook_server, run  # noqa: E402

LIMIT_S = 15 * 60
SL_FIELDS = ["batch_size=32", "lora_rank=16", "learning_rate=2e-3"]
RL_FIELDS = ["batch_size=16", "group_size=8", "max_tokens=40", "lora_rank=16", "learning_rate=1e-3"]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sl-steps", type=int, default=30)
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--loss-fn", default="importance_sampling", help="rl_loop's loss_fn")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tinker_cookbook.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cookbook_server(Path(tmp) / "server") as url:
        sl_rows, sl_wall = run("sl_loop", url, Path(tmp), [*SL_FIELDS, f"max_steps={args.sl_steps}"], LIMIT_S)
        print(f"sl_loop: {args.sl_steps} steps in {sl_wall:.0f} s", flush=True)
        rl_fields = [*RL_FIELDS, f"max_steps={args.rl_steps}", f"loss_fn={args.loss_fn}"]
        rl_rows, rl_wall = run("rl_loop", url, Path(tmp), rl_fields, LIMIT_S)
        print(f"rl_loop: {args.rl_steps} steps in {rl_wall:.0f} s", flush=True)
    nll = [row["train_mean_nll"] for row in sl_rows]
    reward = [row["reward/total"] for row in rl_rows]
    gain = mean(reward[-5:]) - reward[0]
    out = {
        "sl_loop": {
            "fields": [*SL_FIELDS, f"max_steps={args.sl_steps}"],
            "train_mean_nll": nll,
            "step_s": [row["time_total"] for row in sl_rows],
            "wall_s": sl_wall,
            "first_nll": nll[0],
            "last5_nll": mean(nll[-5:]),
        },
        "rl_loop": {
            "fields": rl_fields,
            "reward": reward,
            "step_s": [row["time/total"] for row in rl_rows],
            "wall_s": rl_wall,
            "first_reward": reward[0],
            "last5_reward": mean(reward[-5:]),
            "reward_gain": gain,
        },
        "claim": {
            "sl_loss_falls": mean(nll[-5:]) < nll[0],
            "rl_reward_gain_at_least_0.15": gain >= 0.15,
            "within_15_min": max(sl_wall, rl_wall) <= LIMIT_S,
        },
    }
    write_result(args.json, out)
    print(
        f"sl_loop nll {nll[0]:.4f} -> {mean(nll[-5:]):.4f} ({sl_wall:.0f} s); rl_loop reward {reward[0]:.3f} -> "
        f"{mean(reward[-5:]):.3f} (+{gain:.3f}, {rl_wall:.0f} s); wrote {args.json}"
    )


if __name__ == "__main__":
    main()
