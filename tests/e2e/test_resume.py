"""Kill a GRPO run with SIGKILL at random moments (one of them mid-save), resume it each time with the
same command, and compare its metrics.jsonl with a run that was never killed: equal."""

import json
import random
import signal
import subprocess
import sys
import time

from _kill import run_here

from reinforge.paths import PROJECT_ROOT

ARGS = [
    "loop.max_steps=5",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "checkpoint.resume=auto",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=40",
    "data.max_val_prompts=8",
    "loop.val_every=2",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
]


def command(run_dir, max_steps: int = 5):
    args = [arg if not arg.startswith("loop.max_steps=") else f"loop.max_steps={max_steps}" for arg in ARGS]
    return [
        sys.executable,
        "-m",
        "reinforge.cli",
        "grpo",
        "--config",
        str(PROJECT_ROOT / "configs" / "grpo_demo.yaml"),
        *args,
        f"logging.run_dir={run_dir}",
    ]


def comparable(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def kill_when(run_dir, ready, timeout_s=240):
    """Start the run and SIGKILL it as soon as `ready()` holds (or let it finish)."""
    process = subprocess.Popen(command(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout_s
    while process.poll() is None and time.time() < deadline:
        if ready():
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    process.wait(timeout=60)
    return process.returncode


def test_a_run_killed_at_random_moments_resumes_to_the_same_metrics(tmp_path):
    reference = tmp_path / "uninterrupted"
    began = time.time()
    assert run_here(command(reference)).returncode == 0  # only the killed runs need processes of their own
    duration = time.time() - began  # the random moments below are fractions of it, so they land on any machine
    run = tmp_path / "killed"
    checkpoints = run / "checkpoints"
    rng = random.Random(7)
    started = [0.0]

    def after_random_delay():
        return time.time() - started[0] > rng_delay

    kills = 0
    # 1: mid-save, the moment a checkpoint's temporary directory appears
    assert (
        kill_when(run, lambda: checkpoints.is_dir() and any(p.name.endswith(".tmp") for p in checkpoints.iterdir()))
        == -9
    )
    kills += 1
    # 2 and 3: at random moments of the resumed runs (start-up, generation, training or saving)
    for _ in range(2):
        rng_delay = rng.uniform(0.3, 0.8) * duration  # a resumed run lasts less than a whole one
        started[0] = time.time()
        if kill_when(run, after_random_delay) == -9:
            kills += 1
        newest = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step_"))
        assert all((p / "COMPLETE").is_file() for p in newest), "a half-written checkpoint is visible as a checkpoint"
    final = run_here(command(run))
    assert final.returncode == 0, final.stderr[-3000:]
    assert kills >= 2
    assert comparable(run) == comparable(reference)
    assert len(comparable(run)) == 6  # steps 0..5, none lost, none repeated


def test_resuming_with_another_model_is_refused_naming_the_setting(tmp_path):
    run = tmp_path / "run"
    short = command(run)[: -len(ARGS) - 1] + [
        "loop.max_steps=1",
        "checkpoint.save_every=1",
        "checkpoint.resume=auto",
        "rollout.num_prompts_per_step=4",
        "training.global_batch_size=32",
        "training.micro_batch_size=32",
        "data.max_val_prompts=4",
        f"logging.run_dir={run}",
    ]
    assert run_here(short).returncode == 0
    other = run_here(short + ["optimizer.lr=3e-4"])
    assert other.returncode == 2
    assert (
        other.stderr.strip().splitlines()[-1].startswith("reinforge: error: cannot resume from")
        and "optimizer.lr" in other.stderr
    )


def test_a_corrupted_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(tmp_path):
    """Three steps with a checkpoint each (keep_last 2); then the newest checkpoint's weights are corrupted in
    place (same size, so only the SHA-256 in COMPLETE can tell). Rerun to 4 steps with the same command: it warns
    naming the corrupt checkpoint, resumes from step 2, and ends with the metrics of a 4-step run never stopped."""
    reference, run = tmp_path / "uninterrupted", tmp_path / "corrupted"
    assert run_here(command(reference, max_steps=4)).returncode == 0
    assert run_here(command(run, max_steps=3)).returncode == 0
    newest = run / "checkpoints" / "step_00000003"
    state = next(path for path in (newest / "trainer").iterdir() if path.stat().st_size > 4096)
    with open(state, "r+b") as handle:
        handle.seek(state.stat().st_size // 2)
        handle.write(b"\x00" * 64)
    resumed = run_here(command(run, max_steps=4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"checkpoint {newest} does not match its COMPLETE manifest's checksums (corrupt); skipping it"
        in resumed.stdout + resumed.stderr
    )
    assert "resumed from step_00000002" in resumed.stdout + resumed.stderr
    assert comparable(run) == comparable(reference)
