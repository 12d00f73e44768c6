"""Router replay on the MoE demo: the train/inference logprob mismatch and routing disagreement, replay off and on.

    python bench/moe_replay.py --steps 6 --dtype bfloat16 --json bench/results/moe_replay.json
    python bench/moe_replay.py --engine vllm --dtype bfloat16 ...   # on a GPU (vLLM records routes there only)

Each setting is one `reinforge grpo --config configs/grpo_moe_demo.yaml` subprocess with the same seed, `--steps`
steps, `model.dtype` and engine, and `model.moe.router_replay` off, then `rollout`. Reported per setting and step:
`train/token_mult_prob_error` (exp of the mean absolute difference between the engine's and the trainer's logprobs
of the sampled tokens, docs/metrics.md), the share of response tokens whose top-k experts the trainer's router
chooses differently from the engine (`train/moe/router_disagreement`), the share of tokens the trainer routed as
the engine did (`train/moe/replayed_share`: 1 with replay on), and each run's wall time. In float32 the engine's and
the trainer's forwards differ only in summation order, so few routes flip; bfloat16 flips more.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import run_cli, write_result  # noqa: E402

METRICS = ("train/token_mult_prob_error", "train/moe/router_disagreement", "train/moe/replayed_share")


def run(replay: str, args: argparse.Namespace) -> dict:
    arguments = [
        *("grpo", "--config", str(ROOT / "configs" / "grpo_moe_demo.yaml")),
        *(f"model.dtype={args.dtype}", f"model.moe.router_replay={replay}", f"generation.backend={args.engine}"),
        # bf16 logprobs differ by more than the fp32 start-up gate allows; this benchmark measures them
        "generation.max_logprob_error=100",
    ]
    rows, wall = run_cli(arguments, args.steps, val_every=0)
    steps = [row for row in rows if "train/token_mult_prob_error" in row]
    result = {name: [row.get(name) for row in steps] for name in METRICS}
    result |= {f"{name}_mean": _mean(result[name]) for name in METRICS}
    return result | {"wall_s": wall}


def _mean(values: list) -> float | None:
    values = [value for value in values if value is not None]
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "moe_replay.json")
    args = parser.parse_args()
    result = {"steps": args.steps, "dtype": args.dtype, "engine": args.engine}
    for replay in ("off", "rollout"):
        result[replay] = run(replay, args)
        print(
            f"router_replay={replay:7s}  token_mult_prob_error {result[replay]['train/token_mult_prob_error_mean']}  "
            f"router_disagreement {result[replay]['train/moe/router_disagreement_mean']}  "
            f"replayed_share {result[replay]['train/moe/replayed_share_mean']}  {result[replay]['wall_s']:.0f}s",
            flush=True,
        )
    write_result(args.json, result)


if __name__ == "__main__":
    main()
