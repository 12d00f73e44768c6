"""The fault benchmark's edited_data scenario (bench/faults.py): the whole command is SIGKILLed (its supervisor, the
run and every process under them, as a lost machine would be) after a checkpoint, one row of its training data file is
edited, and the command is run again: it must refuse with one line (exit 2) and change nothing in the run directory.
The file restored, the same command must resume and end with the reference's metrics."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from _kill import descendants
from fault_kinds import read_rows

ROOT = Path(__file__).resolve().parents[1]


def kill_tree(process: subprocess.Popen) -> None:
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run_dir_digest(run_dir: Path) -> str:
    """A digest of every file of the run directory (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(run_dir)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def edit_one_row(path: Path, rng: random.Random) -> int:
    """Change one row's answer (a digit appended); returns its line number."""
    lines = path.read_text().splitlines()
    index = rng.randrange(len(lines))
    row = json.loads(lines[index])
    lines[index] = json.dumps({**row, "answer": f"{row['answer']}0"})
    path.write_text("\n".join(lines) + "\n")
    return index + 1


def run_edited_data(out: Path, command, account, seed: int, timeout_s: float) -> dict:
    rng = random.Random(seed)
    data = out / "edited_train.jsonl"
    shutil.copyfile(ROOT / "data" / "demo" / "train.jsonl", data)
    extra = [f"data.train_path={data}"]
    reference, run_dir = out / "edited_data_reference", out / "edited_data_faulted"
    began = time.time()
    result = subprocess.run(command("grpo_demo.yaml", extra, reference), capture_output=True, text=True,
                            timeout=timeout_s)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"edited_data: the reference run failed: {result.stderr[-2000:]}")
    reference_s = time.time() - began
    step = rng.choice([4, 6])  # the checkpoint the kill follows (checkpoint.save_every=2)
    marker = run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
    cmd = command("grpo_demo.yaml", extra, run_dir)
    with open(out / "edited_data_killed.log", "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while process.poll() is None and not marker.exists() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 2.0))
        killed = process.poll() is None
        kill_tree(process)
    last_step = max((row["step"] for row in read_rows(run_dir / "metrics.jsonl")), default=0)
    original = data.read_bytes()
    line = edit_one_row(data, rng)
    before = run_dir_digest(run_dir)
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    said = [text for text in (refused.stderr + refused.stdout).splitlines() if "error" in text.lower()]
    unchanged = run_dir_digest(run_dir) == before
    data.write_bytes(original)
    began = time.time()
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    resumed_from = re.search(r"resumed from step_(\d+)", resumed.stdout + resumed.stderr)
    from_step = int(resumed_from.group(1)) if resumed_from else 0
    return {
        "scenario": "edited_data",
        "reference_s": round(reference_s, 1),
        "faulted_s": round(time.time() - began, 1),
        "killed_after_step": last_step if killed else None,
        "edited_line": line,
        "refused_exit_status": refused.returncode,  # 2: the data file's pin (size and digest) in the checkpoint
        "refused_error_lines": said[-3:],
        "refused_last_line": (refused.stderr.strip().splitlines() or [""])[-1],
        "run_dir_unchanged_by_refusal": unchanged,
        "exit_status": resumed.returncode,
        "resumed_from_step": from_step,
        "faults_injected": int(killed) + 1,  # the kill, the edit
        "faults_survived": int(killed) + 1 if refused.returncode == 2 and unchanged and resumed.returncode == 0 else 0,
        "steps_redone": max(last_step - from_step, 0) if resumed_from else None,
        **account(reference, run_dir),
    }
