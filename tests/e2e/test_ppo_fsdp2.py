"""PPO with training.backend=fsdp2 end to end: the policy's two FSDP2 ranks and the critic's two (in Ray actors of
their own, gloo on CPU) train on the demo model, the critic's sharded checkpoint is written with the policy's,
and a run killed after step 2 resumes from it."""

import json
import math
import subprocess
import sys

import pytest
from _kill import kill_once_step_checkpointed

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

SETTINGS = [
    "training.backend=fsdp2",
    "training.num_workers=2",
    "loop.max_steps=3",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "checkpoint.resume=auto",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=16",
    "generation.max_new_tokens=40",
    "data.max_val_prompts=8",
    "loop.val_every=0",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
]


def test_ppo_on_fsdp2_trains_the_critic_on_its_own_ranks_and_resumes_it_from_its_sharded_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "reinforge.cli",
        "ppo",
        "--config",
        str(PROJECT_ROOT / "configs" / "ppo_demo.yaml"),
        *SETTINGS,
        f"logging.run_dir={run_dir}",
    ]
    kill_once_step_checkpointed(command, run_dir, step=2)
    critic = run_dir / "checkpoints" / "step_00000002" / "critic"
    assert sorted(path.name for path in critic.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "numerics.json",
        "scheduler.pt",
    ]  # each rank's shards, the skipped-step counters (training/numerics.py)
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step_00000002" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(value) for row in rows for value in row.values() if isinstance(value, float))
    steps = rows[1:]
    assert steps[0]["train/rollout_value_mean"] == 0.0  # a new critic values 0 ...
    assert all(
        row["train/rollout_value_mean"] != 0.0 for row in steps[1:]
    )  # ... and after its updates (restored at step 3), not
    assert all(row["train/critic_num_optimizer_steps"] == 4 and row["train/num_optimizer_steps"] == 1 for row in steps)
    assert all(0 <= row["train/value_clip_fraction"] <= 1 and row["train/value_loss"] > 0 for row in steps)
    assert (run_dir / "checkpoints" / "step_00000003" / "critic" / "scheduler.pt").is_file()
