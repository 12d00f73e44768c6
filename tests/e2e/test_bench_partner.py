"""bench/grpo_vs_trl.py runs reinforge and TRL in two processes that take turns: when one side dies (here TRL's,
at import, without the `bench` extra), the coordinator stops within seconds with that side's error instead
of waiting for its turn forever."""

import importlib.util
import subprocess
import sys
import time

import pytest

from reinforge.paths import PROJECT_ROOT


@pytest.mark.skipif(
    importlib.util.find_spec("trl") is not None, reason="TRL is installed: its side does not die at import"
)
def test_the_benchmark_stops_with_the_trl_sides_import_error_when_trl_is_missing():
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "bench/grpo_vs_trl.py",
            "--steps",
            "1",
            "--models",
            "demo",
            "--async-models",
            "",
            "--json",
            "/dev/null",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and time.monotonic() - start < 60
    # multiprocessing's resource tracker may warn of the dead side's semaphore after the benchmark's last line
    ours = [line for line in result.stderr.strip().splitlines() if "resource_tracker" not in line]
    last = [line for line in ours if not line.strip().startswith("warnings.warn(")][-1]
    assert last.startswith("bench/grpo_vs_trl.py: the trl side failed: ModuleNotFoundError: No module named"), (
        result.stderr[-2000:]
    )
