"""Peak memory of the calling process, as metrics: each worker reports its own (docs/metrics.md, perf/)."""

from __future__ import annotations

import resource
import sys

GIB = 2**30


def memory_metrics(prefix: str = "perf/", children: bool = False) -> dict[str, float]:
    """Peak memory in GiB.

    `{prefix}peak_rss_gb`: the most resident memory this process has held (getrusage's ru_maxrss). On
    Linux a process starts with the peak of the process that spawned it, so a worker spawned by a larger
    process reports at least that one's peak.
    `{prefix}children_peak_rss_gb`, with `children`: the largest peak of its child processes that have
    ended and been waited for (getrusage counts no running child).
    `{prefix}gpu_peak_memory_gb`, where CUDA is available: the most GPU memory torch's allocator has handed
    out on the current device (torch.cuda.max_memory_allocated; the allocator's cache on top is not counted).
    """
    metrics = {f"{prefix}peak_rss_gb": _max_rss_bytes(resource.RUSAGE_SELF) / GIB}
    if children:
        metrics[f"{prefix}children_peak_rss_gb"] = _max_rss_bytes(resource.RUSAGE_CHILDREN) / GIB
    torch = sys.modules.get("torch")  # a process that never imported torch has no GPU memory of its own
    if torch is not None and torch.cuda.is_available():
        metrics[f"{prefix}gpu_peak_memory_gb"] = torch.cuda.max_memory_allocated() / GIB
    return metrics


def _max_rss_bytes(who: int) -> int:
    max_rss = resource.getrusage(who).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, KiB on Linux


class PeakGrowth:
    """How far this process's resident memory rose above where it stood at the start, MiB (`growth_mb` once the
    block is done): Linux's high-water mark (VmHWM) reset at the start (/proc/self/clear_refs), read at the end.
    None where the kernel offers neither."""

    def __init__(self) -> None:
        self.growth_mb: float | None = None

    def __enter__(self) -> "PeakGrowth":
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # resets VmHWM to the current RSS
            self._start = _status_kib("VmRSS")
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None and (peak := _status_kib("VmHWM")) is not None:
            self.growth_mb = (peak - self._start) / 1024


def _status_kib(field: str) -> int | None:
    """A `KiB` field of /proc/self/status (VmRSS, VmHWM), None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
