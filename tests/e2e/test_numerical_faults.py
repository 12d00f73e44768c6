"""Numerical faults end to end on the demo GRPO run (torch backend, short): `optimizer.lr=1e30` and a NaN gradient
planted at step 3 (REINFORGE_FAULT_NONFINITE_AT_STEP) each stop the run with one line and exit 2, never restarted,
with no checkpoint or final model holding a non-finite weight; raising `training.max_nonfinite_steps` and running
again resumes from the last finite checkpoint, skips the planted step, counts it in metrics.jsonl and finishes."""

import json
import os
import subprocess

import torch

from reinforge.training.state import model_state_dict
from tests.e2e.test_resume import command

FAULT_ENV = "REINFORGE_FAULT_NONFINITE_AT_STEP"


def run(run_dir, *overrides, fault_at=None, max_steps=4):
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV} | ({FAULT_ENV: str(fault_at)} if fault_at else {})
    args = command(run_dir, max_steps) + ["checkpoint.save_final=true", "loop.val_every=0", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("reinforge: ")]
    assert len(lines) == 1, result.stderr[-3000:]  # one line, and no restart
    return lines[0]


def all_finite(checkpoint) -> bool:
    return all(torch.isfinite(t).all() for t in model_state_dict(checkpoint / "trainer").values())


def test_a_learning_rate_of_1e30_stops_at_the_first_step_with_one_line(tmp_path):
    result = run(tmp_path / "run", "optimizer.lr=1e30")
    assert one_line_error(result).startswith(
        "reinforge: error: training stopped at step 1: the parameter model.embed_tokens.weight is non-finite"
    )
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


def test_a_nan_step_stops_at_the_limit_and_a_run_started_again_resumes_from_the_last_finite_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    stopped = run(run_dir, "training.max_nonfinite_steps=1", fault_at=3)
    assert one_line_error(stopped).startswith(
        "reinforge: error: training stopped at step 3: the gradient norm is non-finite (the first non-finite "
        "gradient: model.embed_tokens.weight); non-finite optimizer steps in a row: 1"
    )
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step_00000001", "step_00000002"] and all(map(all_finite, checkpoints))
    assert not (run_dir / "final").exists() and not (run_dir / "restarts.jsonl").exists()

    # the planted step again, with a limit above it: skipped, counted, and the run goes on
    resumed = run(run_dir, "training.max_nonfinite_steps=2", "checkpoint.keep_last=1", fault_at=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step_00000002" in resumed.stdout
    assert "step 3: the gradient norm is non-finite" in resumed.stdout  # the skip's warning on the console
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert [row["train/nonfinite_steps"] for row in rows[1:]] == [0.0, 0.0, 1.0, 1.0]
    assert rows[3]["train/grad_norm"] == "nan" and isinstance(rows[4]["train/grad_norm"], float)
    (newest,) = (run_dir / "checkpoints").iterdir()
    assert json.loads((newest / "COMPLETE").read_text())["finite"] and all_finite(newest)
    assert json.loads((newest / "trainer" / "numerics.json").read_text())["skipped"] == 1
