"""tinker-cookbook's own sl_loop and rl_loop, unchanged, against a reinforge Tinker server on this machine (the issue's
claim: sl_loop lowers the demo's SFT loss, rl_loop raises the demo's reward by at least 0.15 within 15 minutes).

    python bench/tinker_cookbook_loops.py --json bench/results/tinker_cookbook_loops.json

One server (configs/tinker_cookbook.yaml: models/tinker_demo under the name the cookbook knows, the torch backend, the
HF engine) in this process; each recipe in a process of its own through scripts/run_tinker_cookbook.py, which only
puts the demo's data where the recipe's `load_dataset` looks and the demo tokenizer in the cookbook's registry. The
recipes' own fields size the runs for a CPU (the defaults ask for 128 problems x 16 samples of 256 tokens a step).
Reported: each step's train_mean_nll (sl_loop) and reward/total (rl_loop) with their step times, each run's wall
time, and the claim: sl_loop's loss over its last 5 steps below its first step's; rl_loop's reward at least 0.15
higher after the run than before, within 15 minutes of wall time. rl_loop draws new problems every step, so its
per-step reward mixes progress with the batch's difficulty; the gain is measured on the same problems instead: the
base model and rl_loop's final sampler weights (its own `final` checkpoint), each sampled through the Tinker API
(`--eval-samples` at temperature 1, `max_tokens` 40) on the first `--eval-problems` of gsm8k's test split (the
demo's val.jsonl) in rl_loop's prompt and scored by rl_loop's `get_reward`. The per-step gain (last 10 steps' mean
reward minus the first 10's) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "scripts")]
from _common import write_result  # noqa: E402
from run_tinker_cookbook import MODEL_NAME, cookbook_server, run  # noqa: E402

LIMIT_S = 15 * 60
TIMEOUT_S = 2 * LIMIT_S  # a run past LIMIT_S still reports (and fails the claim) unless it is this far past
SL_FIELDS = ["batch_size=32", "lora_rank=16", "learning_rate=2e-3"]
RL_FIELDS = ["batch_size=16", "group_size=8", "max_tokens=40", "lora_rank=16", "learning_rate=2e-3"]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def evaluate(model_path: str | None, num_problems: int, num_samples: int) -> float:
    """Mean rl_loop reward of the base model (model_path None) or of saved sampler weights on the first problems of
    data/demo/val.jsonl in rl_loop's prompt, through the Tinker SDK (TINKER_BASE_URL: the running server)."""
    import tinker
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.recipes.rl_loop import get_reward
    from tinker_cookbook_data import gsm8k_records, rl_loop_prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "tinker_demo")
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(MODEL_NAME), tokenizer)
    service = tinker.ServiceClient()
    client = service.create_sampling_client(
        model_path=model_path, base_model=None if model_path else MODEL_NAME
    ).result()
    params = tinker.types.SamplingParams(max_tokens=40, temperature=1.0, stop=renderer.get_stop_sequences())
    problems = gsm8k_records("val")[:num_problems]
    futures = [
        client.sample(renderer.build_generation_prompt(rl_loop_prompt(p["question"])), num_samples, params)
        for p in problems
    ]
    rewards = [
        get_reward(renderers.get_text_content(renderer.parse_response(sequence.tokens)[0]), problem["answer"])
        for future, problem in zip(futures, problems)
        for sequence in future.result().sequences
    ]
    return mean(rewards)


def final_sampler_path(log_path: Path) -> str:
    """The sampler weights of rl_loop's `final` checkpoint (its checkpoints.jsonl)."""
    records = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line]
    return next(r["sampler_path"] for r in reversed(records) if r.get("sampler_path"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sl-steps", type=int, default=30)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--loss-fn", default="importance_sampling", help="rl_loop's loss_fn")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tinker_cookbook_loops.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cookbook_server(Path(tmp) / "server") as url:
        sl_rows, sl_wall = run("sl_loop", url, Path(tmp), [*SL_FIELDS, f"max_steps={args.sl_steps}"], TIMEOUT_S)
        print(f"sl_loop: {args.sl_steps} steps in {sl_wall:.0f} s", flush=True)
        rl_fields = [*RL_FIELDS, f"max_steps={args.rl_steps}", f"loss_fn={args.loss_fn}"]
        rl_rows, rl_wall = run("rl_loop", url, Path(tmp), rl_fields, TIMEOUT_S)
        print(f"rl_loop: {args.rl_steps} steps in {rl_wall:.0f} s", flush=True)
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-reinforge", TINKER_TELEMETRY="0")
        before = evaluate(None, args.eval_problems, args.eval_samples)
        after = evaluate(final_sampler_path(Path(tmp) / "rl_loop"), args.eval_problems, args.eval_samples)
        print(f"rl_loop's reward on {args.eval_problems} held-out problems: {before:.3f} -> {after:.3f}", flush=True)
    nll = [row["train_mean_nll"] for row in sl_rows]
    reward = [row["reward/total"] for row in rl_rows]
    step_gain = mean(reward[-10:]) - mean(reward[:10])
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
            "first10_reward": mean(reward[:10]),
            "last10_reward": mean(reward[-10:]),
            "step_reward_gain": step_gain,
            "heldout_problems": args.eval_problems,
            "heldout_samples_each": args.eval_samples,
            "heldout_reward_before": before,
            "heldout_reward_after": after,
            "heldout_reward_gain": after - before,
        },
        "claim": {
            "sl_loss_falls": mean(nll[-5:]) < nll[0],
            "rl_reward_gain_at_least_0.15": after - before >= 0.15,
            "within_15_min": max(sl_wall, rl_wall) <= LIMIT_S,
        },
    }
    write_result(args.json, out)
    print(
        f"sl_loop nll {nll[0]:.4f} -> {mean(nll[-5:]):.4f} ({sl_wall:.0f} s); rl_loop held-out reward {before:.3f} -> "
        f"{after:.3f}, per-step {mean(reward[:10]):.3f} -> {mean(reward[-10:]):.3f} ({rl_wall:.0f} s)"
    )


if __name__ == "__main__":
    main()
