"""The training benchmarks run (checks that they run, not measurements: docs/benchmarks.md has those)."""

import json
import subprocess
import sys
from pathlib import Path

from reinforge.paths import PROJECT_ROOT


def run_bench(script, *args, timeout_s):
    completed = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=PROJECT_ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(Path(args[args.index("--json") + 1]).read_text())


def test_the_gpu_training_benchmark_runs_on_cpu_with_a_tiny_model(tmp_path):
    """bench/gpu_training_mfu.py is meant for a GPU; --tiny runs the same FSDP2 path on CPU (~7 s)."""
    result = run_bench(
        "gpu_training_mfu.py", "--tiny", "--steps", "1", "--json", str(tmp_path / "out.json"), timeout_s=120
    )
    assert result["median_step_s"] > 0 and result["train_step_flops"] > 0 and result["sequence_packing"]
