"""Where the generation engines run, as rules: one source for the run's checks (rl_config.py before anything
starts, the dry run `--validate`, cluster/generation_group.py when it places them) and for the planner's
candidates (planner.py), so that `reinforge plan` proposes only layouts that the run accepts.

An engine is one Ray actor with `tensor_parallel_size` N workers (vLLM's multiprocessing executor inside the
actor, so its N workers are the actor's children, on the actor's node); `generation.num_workers` M such engines:

- disaggregated (`cluster.colocate=false`): each engine gets a placement bundle of its own holding N workers'
  resources (N GPUs, or N x cluster.num_cpus_per_worker CPUs); on GPU N must fit in one node;
- colocated (`cluster.colocate=true`, FSDP2 ranks): engine i's N workers sit on the bundles of training ranks
  i x N .. i x N + N - 1 (one GPU each), so M x N ranks at most; on GPU those N bundles must be on one node, which
  they are when N divides the GPUs of a node (ranks are placed node by node in rank order).
"""

from __future__ import annotations

from dataclasses import dataclass

from reinforge.errors import ConfigError


@dataclass(frozen=True)
class EngineLayout:
    """M engines of N tensor-parallel workers each, colocated with the training ranks or on resources of their own."""

    num_engines: int
    tp: int
    colocate: bool

    @property
    def workers(self) -> int:
        """Engine workers (GPUs on GPU) of all engines together."""
        return self.num_engines * self.tp

    def config_keys(self) -> dict[str, object]:
        return {
            "cluster.colocate": str(self.colocate).lower(),
            "generation.num_workers": self.num_engines,
            "generation.vllm.tensor_parallel_size": self.tp,
        }


def engine_layout_problem(
    layout: EngineLayout, training_ranks: int, gpus_per_node: int, on_gpu: bool, heads: int | None = None,
    kv_heads: int | None = None,
) -> str | None:  # fmt: skip
    """Why the run refuses `layout` (one line naming the keys), or None when it accepts it. `training_ranks`:
    training.num_workers of the policy (colocation shares their bundles); `heads`/`kv_heads`: the model's attention
    and key/value heads when known (vLLM splits the heads over an engine's workers)."""
    tp, engines = layout.tp, layout.num_engines
    if tp < 1 or engines < 1:
        return "generation.num_workers and generation.vllm.tensor_parallel_size must be >= 1"
    if heads is not None and heads % tp:
        return (
            f"generation.vllm.tensor_parallel_size={tp} must divide the model's {heads} attention heads (vLLM splits "
            f"them over an engine's workers); valid: {[t for t in range(1, heads + 1) if heads % t == 0 and t <= 16]}"
        )
    if kv_heads and (tp % kv_heads if tp > kv_heads else kv_heads % tp):
        return (
            f"generation.vllm.tensor_parallel_size={tp} must divide the model's {kv_heads} key/value heads, or be a "
            "multiple of them (vLLM replicates them then)"
        )
    if on_gpu and tp > gpus_per_node:
        return (
            f"generation.vllm.tensor_parallel_size={tp} exceeds the {gpus_per_node} GPUs of a node "
            "(cluster.gpus_per_node): an engine's workers run on its actor's node"
        )
    if not layout.colocate:
        return None
    if layout.workers > training_ranks:
        return (
            f"generation.num_workers={engines} x generation.vllm.tensor_parallel_size={tp} = {layout.workers} engine "
            f"workers > training.num_workers={training_ranks} with cluster.colocate=true: each engine worker shares "
            "one training rank's resources; lower them or set cluster.colocate=false"
        )
    if on_gpu and gpus_per_node % tp:
        return (
            f"generation.vllm.tensor_parallel_size={tp} must divide cluster.gpus_per_node={gpus_per_node} with "
            "cluster.colocate=true: an engine's workers share the GPUs of consecutive training ranks of one node"
        )
    return None


def check_engine_layout(layout: EngineLayout, training_ranks: int, gpus_per_node: int, on_gpu: bool, **heads) -> None:
    """`engine_layout_problem` as a one-line ConfigError."""
    problem = engine_layout_problem(layout, training_ranks, gpus_per_node, on_gpu, **heads)
    if problem:
        raise ConfigError(problem)


def engine_candidates(
    gpus: int, gpus_per_node: int, heads: int, kv_heads: int, colocate: bool, engine_gpus: int | None = None
) -> list[EngineLayout]:
    """Every engine layout the planner considers, each accepted by `engine_layout_problem`: tp a power of two up
    to a node; colocated, one engine per tp of the `gpus` training GPUs; disaggregated, one engine per tp of the
    `engine_gpus` GPUs of their own (None: one engine)."""
    layouts = []
    for tp in (t for t in (1, 2, 4, 8, 16, 32) if t <= gpus_per_node):
        if colocate and gpus % tp:  # every training GPU serves one engine
            continue
        if colocate:
            layout = EngineLayout(gpus // tp, tp, True)
        else:
            layout = EngineLayout(max((engine_gpus or tp) // tp, 1), tp, False)
        if engine_layout_problem(layout, gpus, gpus_per_node, True, heads, kv_heads) is None:
            layouts.append(layout)
    return layouts
