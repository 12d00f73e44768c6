"""One GRPO batch that mixes math and code records: each task's environment scores its own records
(the code in the real sandbox), and metrics are reported per task."""

import json

import pytest

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every test that starts sandboxes in turn: some count the live sandbox processes
# (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("sandbox")

MIXED = PROJECT_ROOT / "tests" / "data" / "mixed_math_code.jsonl"


def test_a_batch_mixing_math_and_code_trains_with_per_task_metrics(tmp_path):
    config = load_config(
        PROJECT_ROOT / "configs" / "grpo_demo.yaml",
        [
            f"data.train_path={MIXED}",
            f"data.val_path={MIXED}",
            "rollout.num_prompts_per_step=16",
            "training.global_batch_size=128",
            "training.micro_batch_size=64",
            "loop.max_steps=2",
            "loop.val_every=0",
            "generation.max_new_tokens=32",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp_path / 'run'}",
            "loop.val_benchmarks=[gsm8k,humaneval]",
            "loop.val_benchmark_limit=4",
        ],
    )
    result = loops.train(config)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    val, steps = rows[0], rows[1:]
    assert len(steps) == 2
    for row in steps:
        # 16 prompts per step drawn from 24 math + 8 code records: both tasks in every batch (and in the mean)
        assert 0.0 <= row["train/math/reward_mean"] <= 1.0 and row["train/code/reward_mean"] == 0.0
        assert row["env/code/samples"] > 0 and row["env/code/samples"] % config.rollout.num_generations_per_prompt == 0
        assert "env/math/verifier_errors" in row
    # the demo model writes arithmetic, not Python: code scores 0, math is scored by the verifier
    assert val["val/code/accuracy"] == 0.0 and val["val/math/accuracy"] > 0.2
    # the benchmarks of `reinforge eval`, scored inside the run's validation (HumanEval in the sandbox)
    for row in (val, steps[-1]):
        assert 0.0 <= row["val/gsm8k/pass@1"] <= 1.0 and row["val/humaneval/pass@1"] == 0.0 and "val/gsm8k/maj@1" in row
    assert abs(val["val/accuracy"] - (24 * val["val/math/accuracy"] + 8 * val["val/code/accuracy"]) / 32) < 1e-9
