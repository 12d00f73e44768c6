"""`cluster:`, where a run's Ray workers run and with what resources (cluster/worker_group.py uses it).

`TrainerClusterConfig` is the section of a run with no generation engine (SFT, DPO, RM): its threads, its Ray, each
training rank's resources, its restarts. `ClusterConfig`, the RL runs', adds where the engines go. Apart from the
worker groups so that reading a config never imports Ray."""

from __future__ import annotations

from pydantic import Field, field_validator

from reinforge.config.section import Section

RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # set by cluster.* of their own
HEARTBEAT_TIMEOUT_S = 120.0


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
    restart_budget_renew_steps: int = Field(default=5, ge=0)
    """The restarts counted against cluster.max_restarts are those since the run last got this many steps beyond
    the furthest step it had reached at a failure: a run that keeps making progress between rare failures is
    restarted for as long as it does; one that fails again and again at the same place stops. 0: never renewed."""
    worker_timeout_s: float = Field(default=600.0, gt=0)
    """The longest one call to a Ray worker group may take, all its workers together (a dead worker ends it at once):
    past it the run ends with a hang report and is restarted. Leave room for the longest legitimate call (loading the
    model, a training step, a checkpoint)."""
    heartbeat_timeout_s: float = Field(default=HEARTBEAT_TIMEOUT_S, gt=0)
    """A process of the run (the run's own process, watched by the supervisor; a Ray worker, watched by the driver)
    whose heartbeat stops for this long, because it is stopped or wedged in C code holding the GIL, ends the run with
    its process state and a hang report, and the run is restarted. The beats come from a thread of their own, so a
    call that legitimately takes long does not trip it."""
    training_resources: dict[str, float] = {}
    """Custom Ray resources every training rank requires, e.g. {node_a: 1} to keep the ranks on the nodes started
    with `ray start --resources='{"node_a": 8}'` (docs/distributed.md); a node must offer the amount once per
    rank it takes. Empty: any node."""
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs of one node of the cluster, for the checks made before Ray starts (the dry run `--validate`): an
    engine's tensor-parallel workers and a colocated engine's training ranks must be on one node."""

    @field_validator("training_resources", "generation_resources", check_fields=False)
    @classmethod
    def _check_resources(cls, resources: dict[str, float], info) -> dict[str, float]:
        for name, amount in resources.items():
            if not name or name in RAY_OWN_RESOURCES:
                raise ValueError(
                    f"cluster.{info.field_name} names Ray's own resource {name!r}; set cluster.num_cpus_per_worker "
                    "or cluster.num_gpus_per_worker instead, and name only custom resources here"
                )
            if amount <= 0:
                raise ValueError(f"cluster.{info.field_name}.{name}={amount:g} must be > 0")
        return resources


class ClusterConfig(TrainerClusterConfig):
    """`cluster:` of the RL runs: the trainer's, and where the generation engines go."""

    colocate: bool = True
    """With Ray: true puts generation engine i's tensor-parallel workers in the resources of training ranks
    i x N .. i x N + N - 1 (N = generation.vllm.tensor_parallel_size; they take turns); false gives each engine a
    bundle of its own with N workers' resources (disaggregated; training/parallel/engine_layout.py has the rules)."""
    generation_resources: dict[str, float] = {}
    """Custom Ray resources every engine requires (once per engine, whatever its tensor-parallel size), e.g.
    {node_b: 1} to put the engines on the node started with that resource; cluster.colocate=false only (colocated
    engines sit in the training ranks' resources). Empty: any node."""
