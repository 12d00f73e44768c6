"""The fault benchmark's injections (bench/faults.py's module doc lists the kinds): an `Injector` thread that injects
a scenario's faults into one running command, one at a time, and watches its run directory."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

from _kill import cmdline, descendants
from fault_servers import Servers

VICTIMS = {  # the Ray worker process of each kind, by its command line (Ray names it after the worker class)
    "kill_rank": ("ray::Backend",),
    "kill_engine": ("ray::HFGenerationWorker", "ray::VLLMGenerationBackend", "ray::InFlightWorker", "ray::AsyncVLLM"),
    "stop_env": ("ray::EnvWorker",),
}
OUTAGES = {"env_503": "503", "env_trickle": "trickle", "judge_503": "503", "judge_trickle": "trickle"}
OUTAGE_S = 60.0  # how long an HTTP outage lasts
RESTARTING = {"kill_rank", "kill_engine", "stop_env", "kill_driver", "corrupt_checkpoint", "torn_ledger"}
RESTARTING |= {"stop_driver", "lost_node", "disk_full"}  # a restart (restarts.jsonl) is their recovery
TORN_METRICS = b'{"step": 999999, "train/loss": 0.12'  # half a row: the line a crash cuts
NUL_TAIL = b"\0" * 512  # what a filesystem leaves after a power loss: the file's size grew, its data did not land


def read_rows(path: Path) -> list[dict]:
    """A JSONL file's rows, without a line that does not parse (one being written, or torn by a fault)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [row for row in rows if isinstance(row, dict)]


def newest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file())
    return checkpoints[-1] if checkpoints else None


def skipped_steps(run_dir: Path) -> list[int]:
    """The steps whose update was skipped for a non-finite gradient: `train/nonfinite_steps` grew at them (read
    either as a count per step or as a running count)."""
    skipped, before = [], 0.0
    for row in read_rows(run_dir / "metrics.jsonl"):
        value = row.get("train/nonfinite_steps")
        if value is not None:
            if value > before:
                skipped.append(row["step"])
            before = value
    return skipped


class Injector:
    """Injects the faults into one running command and watches the run directory."""

    def __init__(
        self, process: subprocess.Popen, run_dir: Path, kinds: list[str], seed: int, servers: Servers,
        spacing: tuple[int, int] = (1, 3),
    ):  # fmt: skip
        """`kinds`: the faults to inject, in order, each `spacing` (a range) steps after the one before."""
        self.process, self.run_dir, self.kinds, self.servers = process, run_dir, kinds, servers
        self.spacing = spacing
        self.rng = random.Random(seed)
        self.save_every = 2
        self.injected: list[dict] = []
        self.steps_redone = 0
        self._last_step = 0
        self._stopped: list[int] = []
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

    def _inject(self, kind: str) -> dict | None:
        """Inject `kind` now if the run has what it needs; returns what the fault did, None when not yet."""
        if kind == "kill_gym_agent":
            return {} if self.servers.gym.kill_agent() else None
        if kind in OUTAGES:
            self.servers.http.proxy.fault(OUTAGES[kind], OUTAGE_S)
            return {}
        if kind == "nan_grad":  # planted at start (REINFORGE_FAULT_NONFINITE_AT_STEP): it lands when a step is skipped
            return {"skipped_steps": skipped_steps(self.run_dir)} if skipped_steps(self.run_dir) else None
        if kind == "lost_node":
            return {} if self.servers.nodes.lose() else None
        if kind in VICTIMS:
            victims = [pid for pid in descendants(self.process.pid) if any(v in cmdline(pid) for v in VICTIMS[kind])]
            if not victims:
                return None
            os.kill(victims[-1], signal.SIGSTOP if kind == "stop_env" else signal.SIGKILL)
            return {}
        run = self._run_process()
        if run is None:
            return None
        if kind == "disk_full":
            # the next step is a save's (checkpoint.save_every): its ledger rows fit in their files' last pages, the
            # checkpoint's new files do not
            last = max((row["step"] for row in read_rows(self.run_dir / "metrics.jsonl")), default=0)
            if (last + 1) % self.save_every:
                return None
            newest = newest_checkpoint(self.run_dir)
            return {"filled_bytes": self.servers.disk.fill(), "newest_checkpoint": newest.name if newest else None}
        if kind == "stop_driver":
            os.kill(run, signal.SIGSTOP)
            self._stopped.append(run)
            return {}
        if kind == "corrupt_checkpoint":
            checkpoint = newest_checkpoint(self.run_dir)
            weights = sorted((checkpoint / "trainer").rglob("*")) if checkpoint else []
            files = [path for path in weights if path.is_file() and path.stat().st_size > 64]
            if not files:
                return None
            with open(files[0], "r+b") as file:
                file.seek(files[0].stat().st_size // 2)
                file.write(os.urandom(32))
        os.kill(run, signal.SIGKILL)
        if kind == "torn_ledger":  # before the supervisor's restart reads them
            with open(self.run_dir / "metrics.jsonl", "ab") as metrics, open(self.run_dir / "prompts.jsonl", "ab") as p:
                metrics.write(TORN_METRICS)
                p.write(NUL_TAIL)
        return {}

    def _try(self, kind: str) -> dict | None:
        """`_inject`, an error of the benchmark's own recorded with the fault (the run goes on to its end)."""
        try:
            return self._inject(kind)
        except Exception as exc:  # noqa: BLE001
            return {"injection_error": f"{type(exc).__name__}: {exc}"[:300]}

    def _wait(self, seconds: float) -> None:
        until = time.time() + seconds
        while self.process.poll() is None and time.time() < until:
            self._watch_steps()
            time.sleep(0.2)

    def _steps_logged(self) -> int:
        return len(read_rows(self.run_dir / "metrics.jsonl"))

    def _restarts(self) -> int:
        return len(read_rows(self.run_dir / "restarts.jsonl"))

    def _wait_for(self, done, seconds: float = float("inf")) -> None:
        until = time.time() + seconds
        while self.process.poll() is None and not done() and time.time() < until:
            self._wait(0.2)

    def _run(self) -> None:
        """Each fault once the run (restarted or not) has trained `spacing` (1 to 3) more steps, a random 0-2 s into
        the next one, at a moment the run has its victim: tried for up to 120 s."""
        for kind in self.kinds:
            target = self._steps_logged() + self.rng.randint(*self.spacing)
            self._wait_for(lambda: self._steps_logged() >= target)  # noqa: B023
            self._wait(self.rng.uniform(0.0, 2.0))
            restarts_before = self._restarts()
            began = time.time()
            while self.process.poll() is None and (done := self._try(kind)) is None and time.time() - began < 120:
                self._wait(0.5)
            if self.process.poll() is not None or done is None:
                continue
            self.injected.append({"kind": kind, "at_step": self._last_step, "recovered": False, **done})
            self._recover(kind, restarts_before)
        self._wait(float("inf"))
        for pid in self._stopped:  # the supervisor should have ended it; a stopped leftover is the benchmark's to end
            if cmdline(pid):
                self.injected[-1]["stopped_driver_left"] = True
                os.kill(pid, signal.SIGKILL)

    def _recover(self, kind: str, restarts_before: int) -> None:
        """One fault at a time: wait for its recovery (a restart, or the run moving on), or for the run to end."""
        fault = self.injected[-1]
        restarted = lambda: self._restarts() > restarts_before  # noqa: E731
        if kind == "kill_gym_agent":  # its episodes may be retried past the outage without a restart: 60 s moving on
            self._wait_for(restarted, 60)
            fault["recovered"] = True  # the run's end decides too
            return
        if kind == "disk_full":  # space comes back some seconds after the run failed on it
            run = self._run_process()
            self._wait_for(lambda: restarted() or self._run_process() != run, 120)
            fault["run_failed"] = self._run_process() != run or restarted()
            self._wait(5)
            self.servers.disk.free()
        if kind in RESTARTING and kind != "disk_full":
            self._wait_for(restarted)
        else:  # the run moving on past the fault (a step logged after it ended) recovers it, as a restart does
            if kind in OUTAGES:
                self._wait_for(lambda: not self.servers.http.proxy.active())
                fault["faulted_requests"] = self.servers.http.proxy.faulted  # answered 503 or trickled
            steps = self._steps_logged()
            self._wait_for(lambda: restarted() or self._steps_logged() > steps, 600)
            fault["moved_on"] = self._steps_logged() > steps or self.process.poll() == 0
        fault["recovered"] = restarted() or fault.get("moved_on", False)
        if kind == "stop_driver":
            fault["hang_report"] = (self.run_dir / "hang_report.txt").is_file()

    def join(self) -> None:
        self._thread.join()
