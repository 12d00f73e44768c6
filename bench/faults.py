"""The fault benchmark: the demo run with faults injected at random moments, against the same run unfaulted: faults
injected, faults survived, prompts lost, prompts trained twice, steps redone, and the final validation accuracy of both.

    python bench/faults.py --json bench/results/faults.json [--scenarios sync,async,...] [--faults 4]

Each scenario runs `reinforge grpo` through the command line, as a user would: once untouched (the reference), once
with every fault kind of the scenario injected in a random order, each once the run has trained 1 to 3 steps more and
a random 0-2 s into the next step (so they land in generation, training, a refit or a save), at most one at a time,
each after the previous one was recovered from (a restart logged in RUN_DIR/restarts.jsonl, or the run moving on).
The faulted run recovers by itself (reinforge/supervisor.py); nothing is restarted by hand. The first four scenarios
(sync, async, agent, gym) run with `cluster.max_restarts=12` and add random kinds up to `--faults`; the others run
exactly their kinds with the project's default `cluster.max_restarts`. The kinds (bench/fault_kinds.py injects them,
bench/fault_servers.py runs what they need beside the run):
- kill_rank: SIGKILL one FSDP2 training rank (a Ray worker);
- kill_engine: SIGKILL the generation engine's Ray worker (the in-flight engine's too);
- stop_env: SIGSTOP the verifier worker (a Ray actor): found by `cluster.worker_timeout_s`;
- kill_driver: SIGKILL the run's own process (the loop, and the trainer with the torch backend);
- corrupt_checkpoint: overwrite bytes of the newest complete checkpoint's weights, then SIGKILL the run's process: the
  restart must skip that checkpoint (its checksums fail) and resume from the one before;
- kill_gym_agent (the gym scenario: NeMo Gym's simple_agent and vllm_model, from `make gym-venv`, driving the tool
  demo against reinforge's tool_use env served the Gym way): SIGKILL the Gym agent's process, which comes back on
  its port 5 s later; the episodes it dropped are infrastructure failures, never rewards of 0;
- nan_grad: the testing hook REINFORGE_FAULT_NONFINITE_AT_STEP=<a random step 3-5> makes that step's gradients NaN:
  the run skips the step (`train/nonfinite_steps`) and goes on; its prompts are in the ledger, not trained
  (`prompts_skipped_nonfinite`, not lost);
- disk_full: the run directory is on a 160 MiB tmpfs the benchmark mounts (the scenario is skipped, with its reason,
  where mounting is not permitted); a file takes every free byte just before a save (`checkpoint.save_every`) and is
  removed 5 s after the run failed on it: no checkpoint lost, every complete one verifies, the ledgers parse;
- torn_ledger: SIGKILL the run's process and at once append half a row to metrics.jsonl and 512 NUL bytes to
  prompts.jsonl, before the restart reads them;
- env_503, env_trickle: the math verifier served by `reinforge env serve` (env.remote.math) behind an HTTP proxy that,
  for 60 s, answers 503 or sends each answer's body one byte a second; judge_503, judge_trickle: the same in front of a
  deterministic chat judge (env.judge, `[[10]]` when the response's last number is the reference answer) on the demo
  data as task `judge`. The affected samples must be masked and counted (`rollout/infra_*`), none scored 0;
- stop_driver: SIGSTOP the run's own process: the supervisor's heartbeat must notice within
  `cluster.heartbeat_timeout_s`, write hang_report.txt, end it and restart;
- lost_node: Ray's multi-node test cluster on this machine (node A: an FSDP2 rank and the verifier, node B: the
  engine, by custom resources): node B is removed and a fresh one added 5 s later; the run restarts and finishes;
- edited_data (a scenario of its own): the whole command is SIGKILLed after a checkpoint and one row of its training
  data file is edited; running the command again must refuse with one line (exit 2) and change nothing; with the file
  restored, the command resumes and ends with the reference's metrics;
- budget (a scenario): 4 transient faults (kill_driver, stop_env) 6-9 steps apart over a 40-step run with the project's
  default restart budget (cluster.max_restarts=3, renewed after cluster.restart_budget_renew_steps of progress): the
  run must finish.
Prompts are counted by ordinal (RUN_DIR/prompts.jsonl, docs/metrics.md): lost = in the reference but not in the final
run's account, twice = trained on more than once in it, dropped = in it with every sample masked for infrastructure
failures (a group rollout/infra.py dropped), skipped = in it at a step skipped for a non-finite gradient. Steps redone =
steps trained again after a restart. The synchronous and async runs are reproducible, so their metrics must equal the
reference's (to CPU float noise between processes, `metrics_max_abs_diff`) where no sample was masked or step skipped;
agent episodes reach the endpoint in whatever order they run, so the agent scenarios compare accuracy; in flight, which
groups finish first is timing's, so a prompt is lost there when it was drawn and is neither trained nor owed in the last
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the tests' process helpers (_kill.py) and Gym launcher (_gym.py)
import fault_kinds  # noqa: E402
from _kill import cli_command  # noqa: E402
from fault_kinds import Injector, newest_checkpoint, read_rows, skipped_steps  # noqa: E402
from fault_servers import BATCH_32, Servers  # noqa: E402

COMMON = [
    "loop.max_steps=20",
    "loop.val_every=10",
    "rollout.num_prompts_per_step=8",
    "training.global_batch_size=64",
    "training.micro_batch_size=64",
    "checkpoint.save_every=2",
    "checkpoint.keep_last=3",
    "checkpoint.save_final=false",
    "checkpoint.resume=auto",
    "cluster.worker_timeout_s=20",
]
RESTARTS_12 = ["cluster.max_restarts=12"]  # the first four scenarios'; the others keep the project's default
FSDP2_RANKS = ["training.backend=fsdp2", "training.num_workers=2"]
IN_FLIGHT = ["rollout.mode=in_flight", "data.max_val_prompts=8"]  # tests/e2e/test_in_flight_grpo.py's


@dataclass(frozen=True)
class Scenario:
    config: str
    extra: list[str]
    kinds: list[str]
    setup: str = ""  # the servers it needs beside the run (fault_servers.Servers)
    pad: bool = False  # random kinds added up to --faults
    spacing: tuple[int, int] = (1, 3)  # steps trained between one fault and the next


SCENARIOS = {
    "sync": Scenario(
        "grpo_demo.yaml",
        [*FSDP2_RANKS, "env.num_workers=1", "cluster.num_threads=1", *RESTARTS_12],
        ["kill_rank", "kill_engine", "stop_env", "kill_driver", "corrupt_checkpoint"],
        pad=True,
    ),
    "async": Scenario(
        "grpo_async_demo.yaml",
        ["env.num_workers=1", *RESTARTS_12],
        ["kill_engine", "stop_env", "kill_driver", "corrupt_checkpoint"],
        pad=True,
    ),
    "agent": Scenario(
        "grpo_agent_demo.yaml",
        ["data.max_val_prompts=32", "rollout.num_generations_per_prompt=4", *BATCH_32, *RESTARTS_12],
        ["kill_driver", "corrupt_checkpoint"],
        pad=True,
    ),
    "gym": Scenario("grpo_demo.yaml", RESTARTS_12, ["kill_gym_agent", "kill_gym_agent", "kill_driver"], "gym", True),
    "numerics": Scenario("grpo_demo.yaml", [], ["nan_grad", "kill_driver"]),
    "disk": Scenario("grpo_demo.yaml", [], ["disk_full"], "disk"),
    "ledgers": Scenario("grpo_demo.yaml", [], ["torn_ledger", "torn_ledger"]),
    "env_http": Scenario("grpo_demo.yaml", [], ["env_503", "env_trickle"], "env_http"),
    "judge_http": Scenario("grpo_demo.yaml", [], ["judge_503", "judge_trickle"], "judge_http"),
    "driver_stop": Scenario("grpo_demo.yaml", [], ["stop_driver"]),
    "lost_node": Scenario(  # on Ray: an FSDP2 rank on node A, the engine on node B (fault_servers.RayNodes)
        "grpo_demo.yaml",
        ["training.backend=fsdp2", "training.num_workers=1", "env.num_workers=1"],
        ["lost_node"],
        "lost_node",
    ),
    "edited_data": Scenario("grpo_demo.yaml", [], ["edited_data"]),
    "budget": Scenario(  # 4 transient faults over 40 steps, the default cluster.max_restarts (3): renewed by progress
        "grpo_demo.yaml",
        ["loop.max_steps=40", "env.num_workers=1"],
        ["kill_driver", "stop_env", "kill_driver", "stop_env"],
        spacing=(6, 9),
    ),
    "in_flight": Scenario("grpo_demo.yaml", IN_FLIGHT, ["kill_driver", "kill_engine"]),
}


def command(config: str, extra: list[str], run_dir: Path) -> list[str]:
    return cli_command("grpo", ROOT / "configs" / config, *COMMON, *extra, f"logging.run_dir={run_dir}")


def final_accuracy(run_dir: Path) -> float | None:
    values = [row["val/accuracy"] for row in read_rows(run_dir / "metrics.jsonl") if "val/accuracy" in row]
    return values[-1] if values else None


def ordinals(run_dir: Path) -> Counter:
    return Counter(o for row in read_rows(run_dir / "prompts.jsonl") for o in row["ordinals"])


def account(reference: Path, faulted: Path) -> dict:
    """The prompts of `faulted` against `reference`'s, its metrics against theirs."""
    expected, got = ordinals(reference), ordinals(faulted)
    rows = read_rows(faulted / "prompts.jsonl")
    dropped = Counter(o for row in rows for o in row.get("dropped", []))
    skipped_at = set(skipped_steps(faulted))
    skipped = Counter(o for row in rows if row["step"] in skipped_at for o in row["ordinals"])
    infra = Counter()
    for row in read_rows(faulted / "metrics.jsonl"):
        infra.update({k: v for k, v in row.items() if k.startswith("rollout/infra_") and isinstance(v, (int, float))})
    return {
        "prompts_lost": sum((expected - got - dropped).values()),  # gone from the account
        "prompts_dropped_for_infra": sum(dropped.values()),  # in the account, every sample masked (rollout/infra.py)
        "prompts_skipped_nonfinite": sum(skipped.values()),  # in the account, their step skipped (a NaN gradient)
        "prompts_trained_twice": sum(count - 1 for count in got.values() if count > 1),
        "infra": dict(infra),  # rollout/infra_* summed over the steps: the samples masked, not scored
        "final_val_accuracy": final_accuracy(faulted),
        "reference_final_val_accuracy": final_accuracy(reference),
        "metrics_equal_reference": _comparable(faulted) == _comparable(reference),
        "metrics_max_abs_diff": _max_abs_diff(_comparable(faulted), _comparable(reference)),
    }


def _max_abs_diff(rows: list[dict], reference: list[dict]) -> float | None:
    """The largest difference between the two runs' metrics, step by step (None: other steps or other keys). Float
    noise of CPU kernels between processes shows here as ~1e-7, a run that trained on other data as far more."""
    if [sorted(row) for row in rows] != [sorted(row) for row in reference]:
        return None
    return max((_diff(row[key], other[key]) for row, other in zip(rows, reference) for key in row), default=0.0)


def _diff(a, b) -> float:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    return float(a != b)


def _comparable(run_dir: Path) -> list[dict]:
    skip = ("timing/", "perf/")
    return [{k: v for k, v in row.items() if not k.startswith(skip)} for row in read_rows(run_dir / "metrics.jsonl")]


def in_flight_lost(run_dir: Path) -> dict:
    """In flight, which groups finish first depends on timing, so a step's prompts are not the reference's: every
    prompt drawn must be trained once or still owed (finished, or to be generated again) in the last checkpoint
    (tests/e2e/test_in_flight_grpo.py)."""
    from reinforge.training.checkpoint import load_driver_state

    checkpoint = newest_checkpoint(run_dir)
    if checkpoint is None:
        return {"prompts_lost": None}
    last = load_driver_state(checkpoint)
    at = int(checkpoint.name.removeprefix("step_"))
    trained = {o for row in read_rows(run_dir / "prompts.jsonl") if row["step"] <= at for o in row["ordinals"]}
    owed = {o for pending in last["pending_rollouts"] for o, *_ in [*pending.ready, *pending.redo]}
    drawn = last["sampler"]["position"] if last["sampler"]["epoch"] == 0 else None  # ordinal = position, epoch 0
    lost = len(set(range(drawn)) - trained - owed) if drawn is not None else None
    return {"prompts_lost": lost, "prompts_owed_at_end": len(owed)}


def run_dir_intact(run_dir: Path) -> dict:
    """Whether every complete checkpoint verifies (its checksums) and every ledger line parses."""
    from reinforge.training.checkpoint import verifies

    complete = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file())
    bad = [name for name in complete if not verifies(run_dir / "checkpoints" / name)]
    torn = []
    for name in ("metrics.jsonl", "prompts.jsonl"):
        for line in (run_dir / name).read_bytes().splitlines() if (run_dir / name).is_file() else []:
            try:
                json.loads(line)
            except ValueError:
                torn.append(name)
                break
    return {"checkpoints": complete, "checkpoints_failing": bad, "ledgers_torn": torn}


def run_scenario(name: str, out: Path, num_faults: int, seed: int, timeout_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if name == "edited_data":
        from fault_edit import run_edited_data

        return run_edited_data(out, command, account, seed, timeout_s)
    servers = Servers(SCENARIOS[name].setup, out)
    try:
        if servers.disk and not servers.disk.mounted:
            print(f"{name}: skipped: mounting a tmpfs for the run directory is not permitted here ({servers.disk.why})")
            return {"scenario": name, "skipped": f"mount -t tmpfs not permitted: {servers.disk.why}"}
        return _run_scenario(name, out, num_faults, seed, timeout_s, servers)
    finally:
        servers.close()


def _run_scenario(name: str, out: Path, num_faults: int, seed: int, timeout_s: float, servers: Servers) -> dict:
    scenario = SCENARIOS[name]
    extra = scenario.extra + servers.overrides()
    reference = out / f"{name}_reference"
    began = time.time()
    result = subprocess.run(command(scenario.config, extra, reference), capture_output=True, text=True,
                            timeout=timeout_s)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{name}: the reference run failed: {result.stderr[-2000:]}")
    duration = time.time() - began
    rng = random.Random(seed)
    kinds = scenario.kinds
    # every kind once, in a random order, then (the first four scenarios) random kinds up to num_faults
    order = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(max(num_faults - len(kinds), 0))]
    order = order if scenario.pad else order[: len(kinds)]
    environment = dict(os.environ)
    if "nan_grad" in kinds:  # the testing hook of training/backend.py (docs/reliability.md)
        environment["REINFORGE_FAULT_NONFINITE_AT_STEP"] = str(rng.randint(3, 5))
    faulted = (servers.disk.path if servers.disk else out) / f"{name}_faulted"
    began = time.time()
    with open(out / f"{name}_faulted.log", "w") as log:
        process = subprocess.Popen(command(scenario.config, extra, faulted), stdout=log, stderr=subprocess.STDOUT,
                                   env=environment)  # fmt: skip
        injector = Injector(process, faulted, order, seed, servers, scenario.spacing)
        deadline = time.time() + timeout_s
        while process.poll() is None and time.time() < deadline:
            servers.tick()
            time.sleep(0.2)
        if process.poll() is None:
            process.kill()
        returncode = process.wait()
        injector.join()
    result = {
        "scenario": name,
        "reference_s": round(duration, 1),
        "faulted_s": round(time.time() - began, 1),
        "exit_status": returncode,
        "faults": injector.injected,
        "faults_injected": len(injector.injected),
        "faults_survived": sum(f["recovered"] for f in injector.injected) if returncode == 0 else 0,
        "restarts": len(read_rows(faulted / "restarts.jsonl")),
        "restart_causes": [row.get("cause", "")[:300] for row in read_rows(faulted / "restarts.jsonl")],
        "steps_redone": injector.steps_redone,
        **account(reference, faulted),
    }
    if "nan_grad" in kinds:
        result["nonfinite_at_step"] = int(environment["REINFORGE_FAULT_NONFINITE_AT_STEP"])
    if "rollout.mode=in_flight" in scenario.extra:  # the reference's order is not the faulted run's
        result["prompts_not_in_reference_order"] = result["prompts_lost"]
        result.update(in_flight_lost(faulted))
    if servers.disk:
        # lost: the newest complete checkpoint at the fault is gone at the end with none newer
        before = max((f["newest_checkpoint"] or "" for f in injector.injected if "newest_checkpoint" in f), default="")
        result["run_dir"] = run_dir_intact(faulted)
        result["run_dir"]["checkpoint_lost"] = max(result["run_dir"]["checkpoints"], default="") < before
        shutil.copytree(faulted, out / faulted.name, dirs_exist_ok=True)  # the tmpfs goes with the scenario
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--faults", type=int, default=4, help="faults per scenario (sync..gym)")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--timeout-s", type=float, default=1800, help="per run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_faults")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    parser.add_argument("--outage-s", type=float, default=60, help="how long an HTTP outage lasts")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run (a short smoke run)")
    args = parser.parse_args()
    from _common import write_result

    COMMON.extend(args.extra)
    fault_kinds.OUTAGE_S = args.outage_s
    args.out.mkdir(parents=True, exist_ok=True)
    # the scenarios run now replace their earlier results in the file; the others are kept
    earlier = json.loads(args.json.read_text())["scenarios"] if args.json.is_file() else []
    results = {result["scenario"]: result for result in earlier}
    for name in args.scenarios.split(","):
        result = run_scenario(name, args.out / time.strftime("%Y%m%d-%H%M%S"), args.faults, args.seed, args.timeout_s)
        results[name] = {"date": time.strftime("%Y-%m-%d"), **result}
        print(json.dumps({k: v for k, v in result.items() if k != "faults"}))
        write_result(args.json, {"benchmark": "faults", "scenarios": [results[n] for n in SCENARIOS if n in results]})


if __name__ == "__main__":
    main()
