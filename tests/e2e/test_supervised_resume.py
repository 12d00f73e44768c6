"""The supervised loop's checkpoints (loops/supervised.py): `reinforge sft|dpo|rm` on its demo config, shortened,
SIGKILLed once a checkpoint is written and rerun with checkpoint.resume=auto, ends with the metrics (every row,
val/loss included) and the final weights of a run never killed; a SIGKILLed FSDP2 rank of an SFT run restarts the
run from its checkpoint on its own (cluster.max_restarts)."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest
from _kill import cli_command, cmdline, comparable_metrics, descendants, kill_once_step_checkpointed, run_here
from safetensors.torch import load_file

from reinforge.config.loader import load_recipe_config
from reinforge.loops.registry import RECIPES
from reinforge.paths import PROJECT_ROOT

COMMON = [
    "checkpoint.save_every=2",
    "checkpoint.keep_last=1",
    "checkpoint.resume=auto",
    "cluster.num_threads=1",
]
PAIRS = ["training.global_batch_size=16", "training.micro_batch_size=8", "data.max_val_pairs=16"]
RUNS = {
    "sft": ["sft.max_steps=6", "sft.val_every=3", "training.global_batch_size=16", "data.val_fraction=0.1"],
    "dpo": ["dpo.max_steps=6", "dpo.val_every=3", "dpo.reference=precompute", "optimizer.lr=1e-4", *PAIRS],
    "rm": ["rm.max_steps=6", "rm.val_every=3", "scheduler.warmup_steps=2", *PAIRS],
}
TRAIN_FILES = {"sft": "sft.jsonl", "dpo": "preference_train.jsonl", "rm": "preference_train.jsonl"}


def train_slice(recipe: str, tmp_path, num_records: int = 200):
    """The first records of the demo's training file: reading all of it would take most of a short run."""
    name = TRAIN_FILES[recipe]
    lines = (PROJECT_ROOT / "data" / "demo" / name).read_text().splitlines()[:num_records]
    (path := tmp_path / name).write_text("\n".join(lines) + "\n")
    return path


def command_for(recipe: str, tmp_path, *extra: str):
    config = PROJECT_ROOT / "configs" / f"{recipe}_demo.yaml"
    data = f"data.train_path={train_slice(recipe, tmp_path)}"
    return lambda run_dir: cli_command(
        recipe, config, *COMMON, *RUNS[recipe], data, *extra, f"logging.run_dir={run_dir}"
    )


def weight_difference(run_a, run_b) -> float:
    """The largest absolute difference between the two runs' final weights."""
    a, b = (load_file(run / "final" / "model.safetensors") for run in (run_a, run_b))
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.parametrize("recipe", list(RUNS))
def test_a_killed_run_resumes_to_the_metrics_and_weights_of_a_run_never_killed(recipe, tmp_path):
    command_of = command_for(recipe, tmp_path, "cluster.max_restarts=0")  # the kill ends the command: no restart
    reference, run = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted = run_here(command_of(reference))  # only the killed run needs a process of its own
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    kill_once_step_checkpointed(command_of(run), run, step=2)
    resumed = run_here(command_of(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(resumed from step_00000002)" in resumed.stdout, resumed.stdout[-2000:]

    rows = comparable_metrics(run)
    assert [row["step"] for row in rows] == list(range(7))  # none lost, none repeated
    assert rows == comparable_metrics(reference)  # val/loss at steps 0, 3 and 6 among them, to the bit
    assert weight_difference(run, reference) <= 1e-6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000006"]  # keep_last=1


def kill_a_rank_once_checkpointed(process: subprocess.Popen, run_dir, step: int) -> None:
    """SIGKILL the newest FSDP2 rank under `process` once step `step`'s checkpoint in `run_dir` is complete."""
    marker, deadline = run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE", time.time() + 300
    while process.poll() is None and not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    ranks = [pid for pid in descendants(process.pid) if "ray::Backend" in cmdline(pid)]
    if ranks:
        os.kill(ranks[-1], signal.SIGKILL)


@pytest.mark.xdist_group("ray")
def test_a_killed_fsdp2_rank_of_an_sft_run_restarts_it_from_its_checkpoint(tmp_path):
    """Two FSDP2 ranks; once step 2 is checkpointed, one rank is SIGKILLed: the run restarts itself (one row in
    restarts.jsonl, a training rank the cause), resumes from step 2 and ends as one process trains (two ranks give
    one process's run, to float rounding: tests/e2e/test_recipes_fsdp2.py)."""
    command_of = command_for(
        "sft", tmp_path, "training.backend=fsdp2", "training.num_workers=2", "cluster.max_restarts=2"
    )
    run = tmp_path / "killed"
    process = subprocess.Popen(command_of(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killer = threading.Thread(target=kill_a_rank_once_checkpointed, args=(process, run, 2))
    killer.start()
    # meanwhile, while the ranks' Ray starts up: the run in this process, never killed
    reference = tmp_path / "one_process"
    overrides = command_for("sft", tmp_path)(reference)[6:]  # after `--config FILE`
    RECIPES["sft"].train(
        load_recipe_config(RECIPES["sft"].config_class, PROJECT_ROOT / "configs" / "sft_demo.yaml", overrides)
    )
    killer.join()
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]

    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["cause"].startswith("training["), restarts  # the dead rank or its peer
    assert "reinforge: restart 1 of 2" in stderr and "(resumed from step_0000000" in stdout
    rows, expected = comparable_metrics(run), comparable_metrics(reference)
    assert [row["step"] for row in rows] == [row["step"] for row in expected] == list(range(7))
    for row, row_expected in zip(rows, expected):
        for key in [k for k in row_expected if k.startswith(("train/loss", "val/loss"))]:
            assert abs(row[key] - row_expected[key]) <= 1e-4 * max(1.0, abs(row_expected[key])), (row["step"], key)
    assert weight_difference(run, reference) <= 1e-5


def test_an_rl_only_cluster_setting_is_a_one_line_error_with_no_run_directory(tmp_path):
    """As a user types it, through the supervisor (cluster.max_restarts): the setting is not SFT's."""
    run_dir = tmp_path / "run"
    command = cli_command("sft", PROJECT_ROOT / "configs" / "sft_demo.yaml", "cluster.colocate=true")
    result = subprocess.run([*command, f"logging.run_dir={run_dir}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "reinforge: error: unknown config key cluster.colocate: reinforge sft has no such setting; its cluster "
        "settings are num_threads, address, num_cpus, num_cpus_per_worker, num_gpus_per_worker, max_restarts, "
        "restart_budget_renew_steps, worker_timeout_s, heartbeat_timeout_s, training_resources, gpus_per_node"
    )
    assert not run_dir.exists()
