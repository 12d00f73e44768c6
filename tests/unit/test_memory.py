"""Peak memory metrics, measured in fresh processes that allocate a known amount."""

import json
import subprocess
import sys

import torch

from reinforge.logging.memory import memory_metrics

# On Linux a new process starts with its parent's peak (ru_maxrss survives fork and exec), so each
# allocation is made larger than the peak so far, by 0.25 GiB.
PROBE = """
import json, subprocess, sys
from reinforge.logging.memory import GIB, memory_metrics
before = memory_metrics("perf/")["perf/peak_rss_gb"]
block = b"x" * int((before + 0.25) * GIB)  # written, so every page is resident
after = memory_metrics("perf/")["perf/peak_rss_gb"]
del block
child_gb = after + 0.25
subprocess.run([sys.executable, "-c", f"block = b'x' * int({child_gb} * {GIB})"], check=True)
print(json.dumps({"before": before, "after": after, "child_gb": child_gb, **memory_metrics("worker/", children=True)}))
"""


def test_peak_rss_is_at_least_what_the_process_held_and_children_are_counted_apart():
    """The peak after holding a block of B GiB is B plus the interpreter (under 0.15 GiB); a child that held
    C GiB sets the children's peak to C plus its interpreter, and leaves this process's peak alone."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    block_gb = result["before"] + 0.25
    assert block_gb <= result["after"] < block_gb + 0.15
    assert result["worker/peak_rss_gb"] == result["after"]  # freeing the block does not lower the peak
    assert result["child_gb"] <= result["worker/children_peak_rss_gb"] < result["child_gb"] + 0.15


def test_gpu_peak_is_reported_exactly_where_cuda_is_available():
    metrics = memory_metrics("perf/")
    if not torch.cuda.is_available():
        assert sorted(metrics) == ["perf/peak_rss_gb"]
        return
    block = torch.empty(2**30 // 4, dtype=torch.float32, device="cuda")  # 1 GiB
    metrics = memory_metrics("perf/")
    assert metrics["perf/gpu_peak_memory_gb"] >= 1.0
    del block
