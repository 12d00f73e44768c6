"""The fault benchmark: the demo run (synchronous on two FSDP2 ranks, async, the agent demo, and NeMo Gym's agent) with
faults injected at random moments, against the same run unfaulted: faults injected, faults survived, prompts lost,
prompts trained twice, steps redone, and the final validation accuracy of both.

    python bench/faults.py --json bench/results/faults.json [--scenarios sync,async,agent,gym] [--faults 4]

Each scenario runs `reinforge grpo` twice through the command line, as a user would: once untouched (the reference),
once with every fault kind of the scenario injected in a random order (and more, random, up to `--faults`), each once
the run has trained 1 to 3 steps more and a random 0-2 s into the next step (so they land in generation, training,
a refit or a save), at most one at a time, each after the previous one was recovered from (a restart logged in
RUN_DIR/restarts.jsonl, or the run moving on). The
faulted run recovers by itself (`cluster.max_restarts`, reinforge/supervisor.py); nothing is restarted by hand. The
kinds:
- kill_rank: SIGKILL one FSDP2 training rank (a Ray worker);
- kill_engine: SIGKILL the generation engine's Ray worker;
- stop_env: SIGSTOP the verifier worker (a Ray actor): found by `cluster.worker_timeout_s`;
- kill_driver: SIGKILL the run's own process (the loop, and the trainer with the torch backend);
- corrupt_checkpoint: overwrite bytes of the newest complete checkpoint's weights, then SIGKILL the run's process: the
  restart must skip that checkpoint (its checksums fail) and resume from the one before;
- kill_gym_agent (the gym scenario: NeMo Gym's simple_agent and vllm_model, from `make gym-venv`, driving the tool
  demo against reinforge's tool_use env served the Gym way): SIGKILL the Gym agent's process, which comes back on
  its port 5 s later, as a process manager would bring it back; the episodes it dropped are infrastructure failures
  (retried, masked, or the run restarts: docs/environments.md), never rewards of 0.
Prompts are counted by ordinal (RUN_DIR/prompts.jsonl, docs/metrics.md): lost = in the reference but not in the final
run's account, twice = trained on more than once in it, dropped = in it with every sample masked for infrastructure
failures (a group rollout/infra.py dropped). Steps redone = steps trained again after a restart (the work a fault
cost). The synchronous and async runs are reproducible, so their metrics must equal the reference's exactly; agent
episodes reach the endpoint in whatever order they run, so the agent scenarios compare accuracy, not every metric.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the tests' process helpers (_kill.py) and Gym launcher (_gym.py)
from _kill import cli_command, cmdline, descendants  # noqa: E402

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
    "cluster.max_restarts=12",
    "cluster.worker_timeout_s=20",
]
BATCH_32 = ["training.global_batch_size=32", "training.micro_batch_size=32"]  # 8 prompts x 4 samples
SCENARIOS = {
    "sync": (
        "grpo_demo.yaml",
        ["training.backend=fsdp2", "training.num_workers=2", "env.num_workers=1", "cluster.num_threads=1"],
        ["kill_rank", "kill_engine", "stop_env", "kill_driver", "corrupt_checkpoint"],
    ),
    "async": (
        "grpo_async_demo.yaml",
        ["env.num_workers=1"],
        ["kill_engine", "stop_env", "kill_driver", "corrupt_checkpoint"],
    ),
    "agent": (
        "grpo_agent_demo.yaml",
        ["data.max_val_prompts=32", "rollout.num_generations_per_prompt=4", *BATCH_32],
        ["kill_driver", "corrupt_checkpoint"],
    ),
    "gym": ("grpo_demo.yaml", [], ["kill_gym_agent", "kill_gym_agent", "kill_driver"]),  # + GymServers.overrides
}
HOST = "127.0.0.1"
VICTIMS = {  # the Ray worker process of each kind, by its command line (Ray names it after the worker class)
    "kill_rank": ("ray::Backend",),
    "kill_engine": ("ray::HFGenerationWorker", "ray::VLLMGenerationBackend"),
    "stop_env": ("ray::EnvWorker",),
}


def command(config: str, extra: list[str], run_dir: Path) -> list[str]:
    return cli_command("grpo", ROOT / "configs" / config, *COMMON, *extra, f"logging.run_dir={run_dir}")


def read_rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def newest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file())
    return checkpoints[-1] if checkpoints else None


class GymServers:
    """The gym scenario's servers: reinforge's tool_use env served the NeMo Gym way, Gym's vllm_model model server
    pointed at the run's endpoint, and Gym's simple_agent (tests/e2e/_gym.py starts Gym's servers)."""

    def __init__(self, out: Path):
        from contextlib import ExitStack

        from _gym import gym_servers

        from reinforge.data.jsonl import read_jsonl
        from reinforge.network import free_port

        self.gym_servers, self.logs = gym_servers, out / "gym_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        ports = {name: free_port(HOST) for name in ("calculator", "agent", "model", "policy")}
        self.policy_port, self.agent_port = ports["policy"], ports["agent"]
        serve = ["env", "serve", "--protocol", "gym", "--env", "tool_use", "tool_use.tools=[calculator]"]
        self.calculator = subprocess.Popen(
            [sys.executable, "-m", "reinforge.cli", *serve, "--port", str(ports["calculator"])],
            stdout=open(self.logs / "calculator.log", "w"),
            stderr=subprocess.STDOUT,
        )
        self.config = {
            "calculator": {
                "resources_servers": {
                    "reinforge_tool_use": {
                        "entrypoint": "app.py",
                        "domain": "agent",
                        "host": HOST,
                        "port": ports["calculator"],
                    }  # fmt: skip
                }
            },
            "calculator_agent": {
                "responses_api_agents": {
                    "simple_agent": {
                        "entrypoint": "app.py",
                        "host": HOST,
                        "port": ports["agent"],
                        "resources_server": {"type": "resources_servers", "name": "calculator"},
                        "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    }
                }
            },
            "policy_model": {
                "responses_api_models": {
                    "vllm_model": {
                        "entrypoint": "app.py",
                        "host": HOST,
                        "port": ports["model"],
                        "base_url": f"http://{HOST}:{self.policy_port}/v1",
                        "api_key": "none",
                        "model": "policy",
                        "return_token_id_information": True,
                        "uses_reasoning_parser": False,
                    }
                }
            },
        }
        self.models, self.agent, self.restarts = ExitStack(), ExitStack(), 0
        self.models.enter_context(self.gym_servers(self.config, self.logs, external=("calculator", "calculator_agent")))
        self._start_agent()
        ref = {"agent_ref": {"type": "responses_api_agents", "name": "calculator_agent"}}
        for split in ("train", "val"):
            rows = read_jsonl(ROOT / "data" / "tool_demo" / f"{split}.jsonl")[:2000]
            (out / f"gym_{split}.jsonl").write_text("".join(json.dumps({**row, **ref}) + "\n" for row in rows))
        self.data = out

    def _start_agent(self) -> None:
        logs = self.logs / f"agent_{self.restarts}"
        self.agent.enter_context(self.gym_servers(self.config, logs, external=("calculator", "policy_model")))

    def overrides(self) -> list[str]:
        return [
            "model.name_or_path=models/tool_demo",
            f"data.train_path={self.data / 'gym_train.jsonl'}",
            f"data.val_path={self.data / 'gym_val.jsonl'}",
            "data.max_val_prompts=32",
            "rollout.driver=agent",
            "rollout.max_turns=3",
            "rollout.num_generations_per_prompt=4",
            *BATCH_32,
            f"agent.endpoint.port={self.policy_port}",
            f"agent.gym.calculator_agent.url=http://{HOST}:{self.agent_port}",
        ]

    def kill_agent(self) -> bool:
        """SIGKILL the Gym agent's process; it is back on its port 5 s later."""
        victims = [pid for pid in all_pids() if "simple_agent" in cmdline(pid) and "app.py" in cmdline(pid)]
        if not victims:
            return False
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        self.agent.close()  # reaps what is left of it
        time.sleep(5)
        self.restarts += 1
        self._start_agent()
        return True

    def close(self) -> None:
        self.agent.close()
        self.models.close()
        self.calculator.kill()
        self.calculator.wait()


def all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


class Injector:
    """Injects the faults into one running command and watches the run directory."""

    def __init__(self, process: subprocess.Popen, run_dir: Path, kinds: list[str], seed: int, gym: GymServers | None):
        """`kinds`: the faults to inject, in order."""
        self.process, self.run_dir, self.kinds, self.gym = process, run_dir, kinds, gym
        self.rng = random.Random(seed)
        self.injected: list[dict] = []
        self.steps_redone = 0
        self._last_step = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run_process(self) -> int | None:
        runs = [pid for pid in descendants(self.process.pid) if "reinforge.cli grpo" in cmdline(pid)]
        return runs[0] if runs else None

    def _watch_steps(self) -> None:
        steps = [row["step"] for row in read_rows(self.run_dir / "metrics.jsonl")]
        last = max(steps, default=0)
        if last < self._last_step:  # cut back on resume: the steps after the checkpoint are trained again
            self.steps_redone += self._last_step - last
        self._last_step = last

    def _inject(self, kind: str) -> bool:
        if kind == "kill_gym_agent":
            return self.gym.kill_agent()
        if kind in VICTIMS:
            victims = [pid for pid in descendants(self.process.pid) if any(v in cmdline(pid) for v in VICTIMS[kind])]
            if not victims:
                return False
            os.kill(victims[-1], signal.SIGSTOP if kind == "stop_env" else signal.SIGKILL)
            return True
        run = self._run_process()
        if run is None:
            return False
        if kind == "corrupt_checkpoint":
            checkpoint = newest_checkpoint(self.run_dir)
            weights = sorted((checkpoint / "trainer").rglob("*")) if checkpoint else []
            files = [path for path in weights if path.is_file() and path.stat().st_size > 64]
            if not files:
                return False
            with open(files[0], "r+b") as file:
                file.seek(files[0].stat().st_size // 2)
                file.write(os.urandom(32))
        os.kill(run, signal.SIGKILL)
        return True

    def _wait(self, seconds: float) -> None:
        until = time.time() + seconds
        while self.process.poll() is None and time.time() < until:
            self._watch_steps()
            time.sleep(0.2)

    def _steps_logged(self) -> int:
        return len(read_rows(self.run_dir / "metrics.jsonl"))

    def _run(self) -> None:
        """Each fault once the run (restarted or not) has trained 1 to 3 more steps, a random 0-2 s into the next one,
        at a moment the run has its victim: tried for up to 120 s."""
        for kind in self.kinds:
            target = self._steps_logged() + self.rng.randint(1, 3)
            while self.process.poll() is None and self._steps_logged() < target:
                self._wait(0.2)
            self._wait(self.rng.uniform(0.0, 2.0))
            restarts_before = len(read_rows(self.run_dir / "restarts.jsonl"))
            began = time.time()
            while self.process.poll() is None and not self._inject(kind) and time.time() - began < 120:
                self._wait(0.5)
            if self.process.poll() is not None or time.time() - began >= 120:
                continue
            self.injected.append({"kind": kind, "at_step": self._last_step, "recovered": False})
            # one fault at a time: wait for its restart (or for the run to end); a Gym agent's episodes may be
            # retried past its outage without a restart: then the run moving on for 60 s is the recovery
            settle = time.time() + (60 if kind == "kill_gym_agent" else float("inf"))
            while (
                self.process.poll() is None
                and len(read_rows(self.run_dir / "restarts.jsonl")) == restarts_before
                and time.time() < settle
            ):
                self._wait(0.2)
            restarted = len(read_rows(self.run_dir / "restarts.jsonl")) > restarts_before
            self.injected[-1]["recovered"] = restarted or kind == "kill_gym_agent"  # the run's end decides too
        self._wait(float("inf"))

    def join(self) -> None:
        self._thread.join()


def final_accuracy(run_dir: Path) -> float | None:
    values = [row["val/accuracy"] for row in read_rows(run_dir / "metrics.jsonl") if "val/accuracy" in row]
    return values[-1] if values else None


def ordinals(run_dir: Path) -> Counter:
    return Counter(o for row in read_rows(run_dir / "prompts.jsonl") for o in row["ordinals"])


def run_scenario(name: str, out: Path, num_faults: int, seed: int, timeout_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    gym = GymServers(out) if name == "gym" else None
    try:
        return _run_scenario(name, out, num_faults, seed, timeout_s, gym)
    finally:
        if gym:
            gym.close()


def _run_scenario(name: str, out: Path, num_faults: int, seed: int, timeout_s: float, gym: GymServers | None) -> dict:
    config, extra, kinds = SCENARIOS[name]
    extra = extra + (gym.overrides() if gym else [])
    reference = out / f"{name}_reference"
    began = time.time()
    result = subprocess.run(command(config, extra, reference), capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"{name}: the reference run failed: {result.stderr[-2000:]}")
    duration = time.time() - began
    rng = random.Random(seed)
    # every kind once, in a random order, then random kinds up to num_faults
    order = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(max(num_faults - len(kinds), 0))]
    faulted = out / f"{name}_faulted"
    began = time.time()
    with open(out / f"{name}_faulted.log", "w") as log:
        process = subprocess.Popen(command(config, extra, faulted), stdout=log, stderr=subprocess.STDOUT)
        injector = Injector(process, faulted, order, seed, gym)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
        injector.join()
    expected, got = ordinals(reference), ordinals(faulted)
    dropped = Counter(o for row in read_rows(faulted / "prompts.jsonl") for o in row.get("dropped", []))
    return {
        "scenario": name,
        "reference_s": round(duration, 1),
        "faulted_s": round(time.time() - began, 1),
        "exit_status": returncode,
        "faults": injector.injected,
        "faults_injected": len(injector.injected),
        "faults_survived": sum(f["recovered"] for f in injector.injected) if returncode == 0 else 0,
        "restarts": len(read_rows(faulted / "restarts.jsonl")),
        "prompts_lost": sum((expected - got - dropped).values()),  # gone from the account
        "prompts_dropped_for_infra": sum(dropped.values()),  # in the account, every sample masked (rollout/infra.py)
        "prompts_trained_twice": sum(count - 1 for count in got.values() if count > 1),
        "steps_redone": injector.steps_redone,
        "final_val_accuracy": final_accuracy(faulted),
        "reference_final_val_accuracy": final_accuracy(reference),
        "metrics_equal_reference": _comparable(faulted) == _comparable(reference),
    }


def _comparable(run_dir: Path) -> list[dict]:
    skip = ("timing/", "perf/")
    return [{k: v for k, v in row.items() if not k.startswith(skip)} for row in read_rows(run_dir / "metrics.jsonl")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="sync,async,agent,gym")
    parser.add_argument("--faults", type=int, default=4, help="faults per scenario (at least one of each kind)")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--timeout-s", type=float, default=1800, help="per run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_faults")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    args = parser.parse_args()
    from _common import write_result

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
