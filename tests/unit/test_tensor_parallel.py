"""Tensor parallelism with sequence parallelism (training/parallel/tensor.py) on real gloo ranks equals one process.

A Qwen2 with 4 attention heads, 2 key/value heads and a vocabulary of 97 (odd: the vocabulary-parallel head splits
it 49 + 48) trains 3 optimizer steps on GRPO's loss and on SFT's, in one process and at tp=2 (2 ranks) and dp=2 x
tp=2 (4 ranks), at cp=2 (Ulysses, training/parallel/context.py) on sequences twice as long, and as two HSDP copies
(dp_replicate=2); loss, gradient norm, entropy and every weight after the steps agree to 1e-5, for sdpa packed with
shared prompts, eager unpacked, SFT's NLL packed, a critic's squared error through a scalar value head (PPO's
critic, the reward model's score head), and at tp=2 and cp=2 a Qwen3 (per-head q/k norms) and a Llama with
activation checkpointing. One module fixture spawns each world once.
"""

from functools import partial
from types import SimpleNamespace

import _shards
import pytest
import torch
from test_fsdp2_worker import launch
from test_torch_backend import loss_fn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from reinforge.algorithms.losses import token_mean
from reinforge.algorithms.sft import nll_loss
from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.critic import VALUE_HEAD
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig, check_layout

NUM_STEPS = 3
METRICS = ("loss", "grad_norm", "entropy")
SHARED = dict(sequence_packing=True, share_prompts=True)
# (name, model: its attention implementation or family, training settings, loss)
SCENARIOS = (
    ("grpo_sdpa_shared", "sdpa", dict(sequence_packing=True, share_prompts=True), "grpo"),
    ("grpo_eager_padded", "eager", dict(sequence_packing=False), "grpo"),
    ("sft_sdpa_packed", "sdpa", dict(sequence_packing=True, share_prompts=False), "sft"),
    ("critic_sdpa_shared", "sdpa", SHARED, "value"),  # a scalar head
    # the other families' plans (Qwen3's per-head q/k norms, Llama's bias-free projections), and activation
    # checkpointing's recompute: at tp=2 and cp=2 only
    ("qwen3_sdpa_shared", "qwen3", SHARED, "grpo"),
    ("llama_checkpointed_shared", "llama", dict(SHARED, activation_checkpointing=True), "grpo"),
)
FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)), "llama": (LlamaConfig, LlamaForCausalLM, {})}
# (key, ranks, training.parallel); context parallelism trains on sequences twice as long
LAYOUTS = (
    ("tp2", 2, dict(tp=2)),
    ("dp2tp2", 4, dict(tp=2, dp_shard=2)),
    ("cp2", 2, dict(cp=2)),
    ("hsdp2", 2, dict(dp_replicate=2)),  # two model copies (HSDP's replicate dimension), one shard each
)
SCALE = {"tp2": 1, "dp2tp2": 1, "cp2": 2, "hsdp2": 1}
# each rank's share of the tied embedding / LM head [97, 64]
VOCABULARY_ROWS = {
    "tp2": [(49, 64), (48, 64)],
    "dp2tp2": [(25, 64), (24, 64), (24, 64), (24, 64)],
    "cp2": [(49, 64), (48, 64)],  # FSDP2's shards over dp_shard x cp
    "hsdp2": [(97, 64), (97, 64)],  # two whole copies
}
RUNS = {"tp2": SCENARIOS, "cp2": SCENARIOS, "dp2tp2": SCENARIOS[:4], "hsdp2": SCENARIOS[:4]}
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def make_model_dir(path, model):
    """A Qwen2 with `model` as its attention implementation, or a Qwen3 or Llama (sdpa) of the same shape."""
    torch.manual_seed(0)
    config_class, model_class, extra = FAMILIES.get(model, (Qwen2Config, Qwen2ForCausalLM, {}))
    config = config_class(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attn_implementation="sdpa" if model in FAMILIES else model,
        **extra,
    )
    model_class(config).save_pretrained(path)
    return path


def make_batch(scale=1):
    """Pairs of samples of one prompt (the shared-prompt layout shares them), responses of varied length; `scale`
    times longer sequences for context parallelism."""
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(8):
        if row % 2 == 0:
            prompt = torch.randint(2, 97, (scale * (3 + row % 3),), generator=gen).tolist()
        response = torch.randint(2, 97, (scale * (2 + (row * 5) % 7),), generator=gen).tolist()
        trajectories.append(Trajectory(prompt, response, [0.0] * len(response), False, 0.0, row // 2, "math"))
    batch = collate(trajectories, torch.randn(8, generator=gen).tolist(), pad_token_id=0)
    noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=gen)
    batch.old_logprobs = noise * batch.loss_mask  # away from the policy's: the clip is active
    return batch


def value_loss(values_BT, micro, norm):
    """A critic's squared error against the advantages (PPO's value head, RM's score head: `ScalarHead`)."""
    loss = token_mean((values_BT - micro.advantages) ** 2, micro.loss_mask, norm)
    return loss, {"loss": loss.detach()}


LOSSES = {"sft": nll_loss, "grpo": partial(loss_fn, token_mean, 0.0), "value": value_loss}


def run_scenario(strategy, model_dir, training, loss, scale=1):
    torch.manual_seed(0)
    backend = Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=2, global_batch_size=8, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=VALUE_HEAD if loss == "value" else LogprobHead(temperature=0.7),
        strategy=strategy,
    )
    batch = make_batch(scale)
    fn = LOSSES[loss]
    # what this rank holds (before a forward: FSDP2 leaves the root's parameters whole after one) and receives in
    # its logprobs pass (tests/unit/_shards.py)
    held, seen = _shards.held(backend.model), _shards.watch_inputs(backend.model)
    logprobs = backend.logprobs(batch)
    routing = {"rows": _shards.micro_batch_rows(backend, batch), "inputs": _shards.inputs_record(seen)}
    metrics = [backend.train_step(batch, fn) for _ in range(NUM_STEPS)]
    weights = dict(backend.named_weights())
    backend.shutdown()
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights, "held": held, "routing": routing}


def run_rank(rank, world_size, ports, model_dirs, out_dir, parallel, scale):
    torch.set_num_threads(1)
    results = {}
    layout = next(key for key, _, layout_parallel in LAYOUTS if layout_parallel == parallel)
    for port, (name, model, training, loss) in zip(ports, RUNS[layout], strict=True):
        strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
        training = dict(training, parallel=ParallelConfig(**parallel), backend="fsdp2", num_workers=world_size)
        results[name] = run_scenario(strategy, model_dirs[model], training, loss, scale)
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"one": one process's results per scenario and sequence scale; each layout: every rank's per scenario}."""
    base = tmp_path_factory.mktemp("tp")
    model_dirs = {model: make_model_dir(base / model, model) for model in ("sdpa", "eager", *FAMILIES)}
    results = {"model_dirs": model_dirs, "one": {}}
    for scale in (1, 2):
        for name, model, training, loss in SCENARIOS if scale == 1 else RUNS["cp2"]:
            results["one"][name, scale] = run_scenario(None, model_dirs[model], training, loss, scale)
    for key, world_size, parallel in LAYOUTS:
        out_dir = base / key
        out_dir.mkdir()
        ports = len(RUNS[key])  # one process group per scenario, each on a port of its own
        results[key] = launch(
            world_size, model_dirs, out_dir, parallel, SCALE[key], target=run_rank, timeout_s=300, num_ports=ports
        )
    return results


@pytest.mark.parametrize("layout, scenario", [(key, s[0]) for key, _, _ in LAYOUTS for s in RUNS[key]])
def test_tensor_and_context_parallel_training_equals_one_process(runs, layout, scenario):
    one = runs["one"][scenario, SCALE[layout]]
    assert one["metrics"][0]["grad_norm"] > 0
    for rank, result in enumerate(runs[layout]):
        ranked = result[scenario]
        torch.testing.assert_close(ranked["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        for step in range(NUM_STEPS):
            for name in [name for name in METRICS if name in one["metrics"][step]]:
                assert abs(ranked["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (rank, step, name)
    model = next(model for name, model, _, _ in SCENARIOS if name == scenario)
    initial = AutoModelForCausalLM.from_pretrained(runs["model_dirs"][model]).state_dict()
    weights = runs[layout][0][scenario]["weights"]
    assert weights.keys() == one["weights"].keys()
    for name, weight in one["weights"].items():
        if name in initial and not (scenario.startswith("critic") and name == "lm_head.weight"):  # never read
            assert (weight - initial[name]).abs().max() > 0, f"{name} was not updated"
        torch.testing.assert_close(weights[name], weight, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout, scenario", [(key, s[0]) for key, _, _ in LAYOUTS for s in RUNS[key]])
def test_each_rank_holds_its_shards_and_gets_its_rows(runs, layout, scenario):
    """Every parameter's placements and local shape on every rank as the layout says (a skipped plan holds whole
    weights); ranks of a tp or cp group get the same rows, of a dp group different ones (_shards.py)."""
    one = runs["one"][scenario, SCALE[layout]]
    shapes = {name: shape for name, (_, _, shape, _) in one["held"].items()}
    assert one["held"] == _shards.plain(shapes)  # one process: plain tensors
    parallel = next(parallel for key, _, parallel in LAYOUTS if key == layout)
    grid = _shards.Layout(**{"dp_shard": 1, **parallel})
    ranks = runs[layout]
    for rank, result in enumerate(ranks):
        expected = _shards.expected_held(shapes, grid, rank, head_dim=16)
        _shards.assert_held(result[scenario]["held"], expected, f"{layout} {scenario} rank {rank}")
    # the vocabulary split unevenly over tp: 97 rows as 49 + 48, then 49 as 25 + 24 over dp_shard
    embedding = [result[scenario]["held"]["model.embed_tokens.weight"][3] for result in ranks]
    assert embedding == VOCABULARY_ROWS[layout], embedding
    routing = [result[scenario]["routing"] for result in ranks]
    rows = len(make_batch(SCALE[layout]))
    _shards.assert_routing([r["rows"] for r in routing], [r["inputs"] for r in routing], grid, rows)


def test_a_layout_the_model_cannot_take_is_a_one_line_error_naming_the_nearest():
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    with pytest.raises(ConfigError, match="nearest valid tp is 2"):
        check_layout(ParallelConfig(tp=3), config)
    with pytest.raises(ConfigError, match="nearest valid cp is 2"):
        check_layout(ParallelConfig(tp=1, cp=3), config)
    with pytest.raises(ConfigError, match="and gpt2 has none; set training.parallel.tp=1"):
        gpt2 = SimpleNamespace(model_type="gpt2", num_attention_heads=4, intermediate_size=96, num_hidden_layers=2)
        check_layout(ParallelConfig(tp=2), gpt2)
    with pytest.raises(ConfigError, match="must multiply to training.num_workers=4"):
        ParallelConfig(tp=3).resolved(4)
    assert ParallelConfig(tp=2).resolved(8).dp_shard == 4
