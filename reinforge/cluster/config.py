"""`cluster:`, where a run's Ray workers run and with what resources (cluster/worker_group.py uses it).

`TrainerClusterConfig` is the section of a run with no generation engine (SFT, DPO, RM): its threads, its Ray, each
training rank's resources, its restarts. `ClusterConfig`, the RL runs', adds where the engines go. Apart from the
worker groups so that reading a config never imports Ray."""

from __future__ import annotations

from pydantic import Field

from reinforge.config.section import Section


class TrainerClusterConfig(Section):
    num_threads: int = Field(default=0, ge=0)
    """torch intra-op threads per process; 0 keeps torch's default (all cores). 1 avoids thread contention on a
    shared machine; the results do not depend on it."""
    address: str = ""
    """Ray cluster to use: empty starts a local Ray; `auto` or HOST:PORT joins a running cluster."""
    num_cpus: int = 0
    """CPUs a local Ray may use; 0: all of this machine's."""
    num_cpus_per_worker: float = 1.0
    """CPUs reserved for each Ray worker (training rank)."""
    num_gpus_per_worker: float = 0.0
    """GPUs reserved for each Ray worker; 1 on a GPU cluster."""
    max_restarts: int = Field(default=3, ge=0)
    """When a component dies (a training rank, an engine, the critic, a teacher, an env worker, the run's own process)
    or hangs past its deadline, the run restarts itself from its last complete checkpoint, up to this many times
    (each restart is logged in RUN_DIR/restarts.jsonl with its cause); 0: the run stops at the first such failure."""
    worker_timeout_s: float = 600.0
    """A worker call that makes no progress for this long ends the run (a dead worker ends it at once)."""


class ClusterConfig(TrainerClusterConfig):
    """`cluster:` of the RL runs: the trainer's, and where the generation engines go."""

    colocate: bool = True
    """With Ray: true puts generation engine i in training rank i's resources (they take turns);
    false gives the engines resources of their own (split placement)."""
