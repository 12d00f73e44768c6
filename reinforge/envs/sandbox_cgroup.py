"""A cgroup v2 per sandbox run (`SandboxLimits.memory_cgroup`): the whole run's memory (its processes and
what it writes to its tmpfs) bounded by `memory.max`, its processes by `pids.max`, and a count of the
kernel's out-of-memory kills inside it, which tells the program's own excess from the host's shortage.

The directory given must be a cgroup v2 directory the trainer may write whose `cgroup.subtree_control`
enables `memory` (a delegated subtree, e.g. `systemd-run --user -p Delegate=yes --scope`, with the trainer
moved into a leaf of its own: cgroup v2 lets a process move only between cgroups whose common ancestor it
may write). Each run gets a child `reinforge-<random>`, which the supervisor joins before it forks, so
every process of the run is in it; the child is killed whole (`cgroup.kill`) and removed after the run."""

from __future__ import annotations

import contextlib
import os
import secrets
import time


def create(limits) -> str:
    """A fresh child of `limits.memory_cgroup` with the run's limits (`SandboxLimits`: its module imports
    this one); OSError when that directory does not allow it."""
    parent, memory_mb, max_processes = limits.memory_cgroup, limits.memory_mb, limits.max_processes
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as control:
            enabled = control.read().split()
    except OSError:
        enabled = []
    if "memory" not in enabled:
        raise OSError(f"{parent} is not a cgroup v2 directory whose cgroup.subtree_control enables memory")
    path = os.path.join(parent, f"reinforge-{secrets.token_hex(6)}")
    os.mkdir(path)
    try:
        _write(path, "memory.max", str(memory_mb << 20))
        for name, value in (("memory.swap.max", "0"), ("pids.max", str(max_processes))):
            if os.path.exists(os.path.join(path, name)):  # swap accounting, pids: where enabled
                _write(path, name, value)
    except OSError:
        remove(path)
        raise
    return path


def oom_kills(path: str) -> int:
    """Processes of the run the kernel's OOM killer killed for the cgroup's own limit."""
    try:
        with open(os.path.join(path, "memory.events")) as events:
            return next((int(line.split()[1]) for line in events if line.startswith("oom_kill ")), 0)
    except OSError:
        return 0


def remove(path: str) -> None:
    """Kill whatever is left in the cgroup and remove it (a cgroup with processes cannot be removed)."""
    with contextlib.suppress(OSError):
        _write(path, "cgroup.kill", "1")  # Linux 5.14+; the supervisor has emptied it already otherwise
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the kernel reaps the last processes
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _write(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w") as file:
        file.write(value)
