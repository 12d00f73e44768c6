"""Router replay and the routing metrics of an MoE policy in the trainer (training/moe.py), on the tiny Qwen3-MoE.

The references run a separate copy of the model one sequence at a time (no padding, no packing): for forced
routes, each MoE block's output is written here from the weights, token by token,
out_t = sum_k w_k down_e(silu(gate_e h_t) * up_e h_t) over the forced experts e = r_tk, with
w_k = softmax(h_t G^T)[r_tk] / sum_j softmax(h_t G^T)[r_tj] (norm_topk_prob).
"""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ConfigError
from reinforge.logging.report import write_report
from reinforge.model_config import ModelConfig, MoeConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.micro_batching import token_logprobs
from reinforge.training.moe import MoeRouting
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

NUM_EXPERTS, TOP_K, NUM_LAYERS = 4, 2, 2


def small_batch(seed=0):
    """Three prompts, two answers each (so packing shares the prompts), 3-6 prompt and 2-7 answer tokens."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for group in range(3):
        prompt = torch.randint(2, 64, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(2):
            answer = torch.randint(2, 64, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen).tolist()
            trajectories.append(Trajectory(prompt, answer, [0.0] * len(answer), False, 0.0, group, "math"))
    return collate(trajectories, [1.0, -1.0] * 3, pad_token_id=0)


def backend(model_dir, replay="off", aux_loss_coef=0.0, **training) -> Backend:
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir), moe=MoeConfig(router_replay=replay, aux_loss_coef=aux_loss_coef)),
        TrainingConfig(global_batch_size=6, micro_batch_size=6, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(1.0),
    )


def sum_logprobs(outputs_BT, micro, norm):
    """A loss whose gradient is that of the trained tokens' summed logprobs."""
    return -(outputs_BT * micro.loss_mask).sum() / norm.num_tokens, {}


def sequences(batch):
    return [batch.input_ids[b, : int(n)] for b, n in enumerate(batch.attention_mask.sum(dim=1))]


def reference_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def router_logits(model, batch, grad=False):
    """Each sequence's router logits per layer, [T, E] each, from an unforced one-sequence forward."""
    captured = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: captured.append(out[0])) for layer in model.model.layers
    ]
    per_sequence = []
    with torch.set_grad_enabled(grad):
        for ids in sequences(batch):
            captured.clear()
            model(input_ids=ids[None])
            per_sequence.append(list(captured))
    for hook in hooks:
        hook.remove()
    return per_sequence  # [sequence][layer] -> [T, E]


def routes_from(per_sequence, batch, pick):
    """[B, T, L, K] routes: `pick(logits_TE)` per sequence and layer, -1 on padding."""
    routes = torch.full((*batch.input_ids.shape, NUM_LAYERS, TOP_K), -1, dtype=torch.long)
    for b, layers in enumerate(per_sequence):
        for layer, logits in enumerate(layers):
            routes[b, : len(logits), layer] = pick(logits)
    return routes


def hand_moe_block(mlp, hidden_1TH, routes_TK):
    """The MoE block's output with forced experts, one token and one expert at a time (see the module docstring)."""
    out = torch.zeros_like(hidden_1TH[0])
    experts = mlp.experts
    for t, h in enumerate(hidden_1TH[0]):
        probs = torch.softmax(h @ mlp.gate.weight.T, dim=-1)
        chosen = routes_TK[t]
        weights = probs[chosen] / probs[chosen].sum()
        for w, e in zip(weights, chosen.tolist()):
            gate_up = experts.gate_up_proj[e] @ h
            gate, up = gate_up[: gate_up.shape[0] // 2], gate_up[gate_up.shape[0] // 2 :]
            out[t] += w * (experts.down_proj[e] @ (F.silu(gate) * up))
    return out[None]


@torch.no_grad()
def forced_reference_logprobs(model, batch, routes_BTLK):
    """[B, T] logprobs of a forward whose MoE blocks are `hand_moe_block` with the given routes."""
    logprobs = torch.zeros(batch.input_ids.shape)
    for b, ids in enumerate(sequences(batch)):
        hooks = [
            layer.mlp.register_forward_hook(
                lambda m, args, out, layer_index=i: hand_moe_block(m, args[0], routes_BTLK[b, : len(ids), layer_index])
            )
            for i, layer in enumerate(model.model.layers)
        ]
        logits = model(input_ids=ids[None]).logits
        for hook in hooks:
            hook.remove()
        logprobs[b, : len(ids)] = token_logprobs(logits, ids[None], 1.0)[0]
    return logprobs * batch.loss_mask


def last_ranked(logits_TE):
    return logits_TE.argsort(dim=-1)[:, :TOP_K]  # the experts the router ranks lowest


def own_choice(logits_TE):
    return logits_TE.topk(TOP_K, dim=-1).indices


def test_replayed_routes_give_the_logprobs_of_a_forward_with_those_experts(tiny_moe_model_dir):
    """Forcing the experts the router ranks last gives the hand-built forward's logprobs (to 1e-6), not the
    router's own; the training pass still sends a gradient to every router."""
    batch = small_batch()
    reference = reference_model(tiny_moe_model_dir)
    routes = routes_from(router_logits(reference, batch), batch, last_ranked)
    batch.routed_experts = routes
    replayed = backend(tiny_moe_model_dir, replay="rollout")
    logprobs = replayed.logprobs(batch)
    torch.testing.assert_close(logprobs, forced_reference_logprobs(reference, batch, routes), atol=1e-6, rtol=0)
    unforced = backend(tiny_moe_model_dir).logprobs(batch)
    assert (logprobs - unforced).abs().max() > 1e-2
    metrics = replayed.accumulate_gradients(batch, sum_logprobs)
    for layer in replayed.model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    assert metrics["moe/replayed_share"] == pytest.approx(1.0)
    assert metrics["moe/router_disagreement"] > 0.5  # the router never ranks its last two first


def test_replaying_the_routers_own_routes_changes_nothing(tiny_moe_model_dir):
    batch = small_batch()
    batch.routed_experts = routes_from(router_logits(reference_model(tiny_moe_model_dir), batch), batch, own_choice)
    replayed = backend(tiny_moe_model_dir, replay="rollout")
    torch.testing.assert_close(replayed.logprobs(batch), backend(tiny_moe_model_dir).logprobs(batch), atol=1e-6, rtol=0)
    metrics = replayed.evaluate(batch, sum_logprobs)
    assert metrics["moe/replayed_share"] == pytest.approx(1.0)
    assert metrics["moe/router_disagreement"] == 0.0


def test_routing_metrics_match_hand_computed_values(tiny_moe_model_dir):
    """Over the batch's N real tokens (a shared prompt counted once per sequence) and each layer's top-2:
    share_e = assignments to e / (2N), load_cv = std_e(share) / mean_e(share) (population std), entropy the
    token mean of H(softmax(logits)), aux_loss transformers' load_balancing_loss_func over all layers' logits."""
    batch = small_batch()
    per_sequence = router_logits(reference_model(tiny_moe_model_dir), batch)
    layers = [torch.cat([s[layer] for s in per_sequence]) for layer in range(NUM_LAYERS)]
    metrics = backend(tiny_moe_model_dir).evaluate(batch, sum_logprobs)
    cvs, max_shares, entropies = [], [], []
    for layer, logits_NE in enumerate(layers):
        load = torch.bincount(own_choice(logits_NE).flatten(), minlength=NUM_EXPERTS).float()
        share = load / load.sum()
        cvs.append(float(share.std(unbiased=False) / share.mean()))
        max_shares.append(float(share.max()))
        p = torch.softmax(logits_NE, dim=-1)
        entropies.append(float(-(p * p.log()).sum(dim=-1).mean()))
        assert metrics[f"moe/load_cv_layer{layer}"] == pytest.approx(cvs[-1], abs=1e-5)
    assert metrics["moe/load_cv"] == pytest.approx(sum(cvs) / NUM_LAYERS, abs=1e-5)
    assert metrics["moe/max_expert_share"] == pytest.approx(max(max_shares), abs=1e-6)
    assert metrics["moe/router_entropy"] == pytest.approx(sum(entropies) / NUM_LAYERS, abs=1e-5)
    aux = float(load_balancing_loss_func(tuple(layers), NUM_EXPERTS, TOP_K))
    assert metrics["moe/aux_loss"] == pytest.approx(aux, abs=1e-5)
    assert "moe/router_disagreement" not in metrics  # no recorded routes


@pytest.mark.parametrize(
    "layout",
    [dict(sequence_packing=False), dict(sequence_packing=True, share_prompts=False), dict(micro_batch_tokens=24)],
)
def test_forced_logprobs_do_not_depend_on_the_layout(tiny_moe_model_dir, layout):
    """Padded, packed, and packed with shared prompts over token-budget micro-batches: the same forced logprobs."""
    batch = small_batch()
    batch.routed_experts = routes_from(router_logits(reference_model(tiny_moe_model_dir), batch), batch, last_ranked)
    shared = backend(tiny_moe_model_dir, replay="rollout", sequence_packing=True, share_prompts=True)
    other = backend(tiny_moe_model_dir, replay="rollout", **layout)
    torch.testing.assert_close(other.logprobs(batch), shared.logprobs(batch), atol=1e-6, rtol=0)


def test_aux_loss_coef_adds_exactly_coef_times_its_gradient(tiny_moe_model_dir):
    """grad(loss + c * aux) - grad(loss) = c * grad(aux), aux transformers' load_balancing_loss_func over the
    batch's router logits (one micro-batch, so the per-forward loss is the batch's)."""
    coef = 0.5
    batch = small_batch()
    plain = backend(tiny_moe_model_dir)
    plain.accumulate_gradients(batch, sum_logprobs)
    balanced = backend(tiny_moe_model_dir, aux_loss_coef=coef)
    balanced.accumulate_gradients(batch, sum_logprobs)
    reference = reference_model(tiny_moe_model_dir)
    per_sequence = router_logits(reference, batch, grad=True)
    layers = tuple(torch.cat([s[layer] for s in per_sequence]) for layer in range(NUM_LAYERS))
    load_balancing_loss_func(layers, NUM_EXPERTS, TOP_K).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert any(name.endswith("mlp.gate.weight") for name in expected)
    for name, parameter in balanced.model.named_parameters():
        difference = parameter.grad - dict(plain.model.named_parameters())[name].grad
        torch.testing.assert_close(
            difference, coef * expected.get(name, torch.zeros_like(difference)), atol=1e-6, rtol=0
        )


def test_activation_checkpointing_recomputes_the_replayed_routes(tiny_moe_model_dir):
    """The backward pass's recompute of each layer routes as its forward did: the same gradients, replayed routes
    and auxiliary loss included, with and without activation checkpointing."""
    batch = small_batch()
    batch.routed_experts = routes_from(router_logits(reference_model(tiny_moe_model_dir), batch), batch, last_ranked)
    grads = []
    for checkpointing in (False, True):
        trained = backend(
            tiny_moe_model_dir, replay="rollout", aux_loss_coef=0.5, activation_checkpointing=checkpointing
        )
        trained.accumulate_gradients(batch, sum_logprobs)
        grads.append({name: p.grad for name, p in trained.model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def test_token_mean_metrics_do_not_depend_on_the_micro_batches(tiny_moe_model_dir):
    """Entropy and the route shares are token means over the whole batch, however it is cut."""
    batch = small_batch()
    batch.routed_experts = routes_from(router_logits(reference_model(tiny_moe_model_dir), batch), batch, last_ranked)
    whole = backend(tiny_moe_model_dir, replay="rollout").evaluate(batch, sum_logprobs)
    cut = backend(tiny_moe_model_dir, replay="rollout", micro_batch_tokens=16).evaluate(batch, sum_logprobs)
    for name in ("moe/router_entropy", "moe/router_disagreement", "moe/replayed_share"):
        assert cut[name] == pytest.approx(whole[name], abs=1e-6), name


def test_the_run_report_shows_the_routing_metrics(tmp_path):
    rows = [
        {
            "step": s,
            "train/moe/load_cv": 0.5 / s,
            "train/moe/max_expert_share": 0.4,
            "train/moe/aux_loss": 2.1,
            "train/moe/router_entropy": 1.2,
            "train/moe/router_disagreement": 0.1,
            "train/moe/replayed_share": 1.0,
        }
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = {p.name for p in write_report(tmp_path)}
    assert {"moe_load.png", "moe_routing.png"} <= written
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| `train/moe/load_cv` | 0.5 | 0.25 | 0.25 | 2 |" in summary
    assert "| `train/moe/router_disagreement` | 0.1 | 0.1 | |" in summary


def test_router_replay_of_an_unsupported_router_is_a_config_error():
    """GPT-OSS routes with a biased top-k before its softmax: not the router replay forces."""
    config = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    with pytest.raises(ConfigError, match="does not support gpt_oss's router"):
        MoeRouting(GptOssForCausalLM(config), replay=True)
