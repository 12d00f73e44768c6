"""GRPO through the command line with tensor parallelism: a vLLM engine refitted from two tensor-parallel ranks
(training.parallel.tp=2 on two FSDP2 ranks in Ray actors) passes the mismatch gate and the refit check on every step,
and so does a vLLM engine of two tensor-parallel workers (its own size, whatever the trainer's layout) refitted from
one process. That tp=2 computes one process's step is tests/unit/test_tensor_parallel.py's."""

import subprocess

import pytest
from test_fsdp2_grpo import COMMAND, read_metrics

pytestmark = pytest.mark.xdist_group("ray")

SHORT = ["loop.val_every=0", "data.max_val_prompts=1"]
TP = ["training.parallel.tp=2", *SHORT]
LAYOUTS = {
    "trainer_tp2": TP,
    "engine_tp2": ["training.backend=torch", "training.num_workers=1", "generation.vllm.tensor_parallel_size=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vllm_refitted_across_tensor_parallel_layouts_passes_the_mismatch_gate(tmp_path, layout):
    command = [
        *COMMAND,
        *SHORT,
        *LAYOUTS[layout],
        "generation.backend=vllm",
        "loop.max_steps=3",
        "cluster.num_threads=1",
        f"logging.run_dir={tmp_path / 'run'}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    errors = [row["train/token_mult_prob_error"] for row in rows[1:]]
    assert all(error <= 1.05 for error in errors), errors
    assert all(row["timing/refit_verify_s"] > 0 for row in rows[1:])  # every refit's weights were checked
