"""A GRPO run checkpointed on 2 FSDP2 ranks resumes under another layout with the next step of the run never
stopped (checkpoints reshard: training/state.py).

The reference trains the demo 2 steps on 2 FSDP2 ranks (Ray actors, gloo), checkpointing each step. A copy of its
run directory without the step-2 checkpoint resumes from step 1 under each layout below and retrains step 2: its
rollouts are the same samples (the engine is refitted with the very weights the ranks saved), so its metrics must
equal the reference's to 1e-5 (only the sums' order differs between layouts), and so must the step-2 weights it
writes under its own layout (all of them in one process; with tensor parallelism all but a few, see LAYOUTS).
"""

import shutil
import subprocess

import pytest
from _kill import cli_command, comparable_metrics

from reinforge.paths import PROJECT_ROOT
from reinforge.training.convert import policy_state_dict

pytestmark = pytest.mark.xdist_group("ray")

SETTINGS = [
    *("loop.max_steps=2", "loop.val_every=2", "data.max_val_prompts=4", "checkpoint.save_every=1"),
    *("checkpoint.keep_last=0", "checkpoint.resume=auto", "checkpoint.save_final=false", "cluster.num_threads=1"),
    *("rollout.num_prompts_per_step=4", "generation.max_new_tokens=40"),
    *("training.global_batch_size=32", "training.micro_batch_size=16"),
]
TWO_RANKS = ["training.backend=fsdp2", "training.num_workers=2"]
# the layouts the reference's step-1 checkpoint resumes under, each with the share of step 2's weights that may be
# more than 1e-5 off (and at most lr, one AdamW step): the vocabulary-parallel LM head sums the tied embedding's
# gradient in another order, and AdamW's m / sqrt(v) turns the rows of tokens never sampled, whose gradients are
# ~1e-12, into steps of up to lr either way (measured: 29 of 57,472 embedding entries, 4.2e-5)
LAYOUTS = [
    pytest.param(["training.backend=torch", "training.num_workers=1"], 0.0, id="one_process"),
    pytest.param([*TWO_RANKS, "training.parallel.tp=2"], 1e-3, id="tensor_parallel"),
]
LR = 1e-4  # configs/grpo_demo.yaml's
STEP_1, STEP_2 = "step_00000001", "step_00000002"


def command(run_dir, layout):
    config = PROJECT_ROOT / "configs" / "grpo_demo.yaml"
    return cli_command("grpo", config, *SETTINGS, *layout, f"logging.run_dir={run_dir}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reshard") / "two_ranks"
    result = subprocess.run(command(run_dir, TWO_RANKS), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def differences(got: list[dict], expected: list[dict]) -> list[tuple]:
    """(step, metric, got, expected) for each metric of either that is not equal to 1e-5 (relative past 1); the
    ranks' own memory metrics (`perf/training[r]/...`) are left out with the other timings and throughputs."""
    found = []
    for row, other in zip(got, expected, strict=True):
        for name in sorted(set(row) | set(other)):
            a, b = row.get(name), other.get(name)
            if isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-5 * max(1.0, abs(b)):
                continue
            if a != b:
                found.append((row["step"], name, a, b))
    return found


@pytest.mark.parametrize("layout, off_fraction", LAYOUTS)
def test_a_run_checkpointed_on_two_fsdp2_ranks_resumes_under_another_layout_with_the_same_next_step(
    reference, tmp_path, layout, off_fraction
):
    run_dir = tmp_path / "resumed"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / STEP_2)
    resumed = subprocess.run(command(run_dir, layout), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {STEP_1}" in resumed.stdout
    expected = comparable_metrics(reference)
    assert [row["step"] for row in expected] == [0, 1, 2] and expected[2]["train/grad_norm"] > 0
    assert differences(comparable_metrics(run_dir), expected) == []
    weights, reference_weights, before = (
        policy_state_dict(directory / "checkpoints" / step / "trainer")
        for directory, step in ((run_dir, STEP_2), (reference, STEP_2), (reference, STEP_1))
    )  # the resumed run's step 2 was written under its own layout
    assert weights.keys() == reference_weights.keys()
    for name, weight in reference_weights.items():
        off = (weights[name] - weight).abs()
        assert (off > 1e-5).float().mean() <= off_fraction and off.max() <= LR, (name, off.max())
    assert max((weight - before[name]).abs().max().item() for name, weight in reference_weights.items()) > 0
