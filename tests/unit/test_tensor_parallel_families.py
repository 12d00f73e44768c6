"""Tensor parallelism (training/parallel/tensor_plan.py) equals one process for every family of the conformance
matrix that it splits (tests/model_families.py's tiny models, MoE included), and refuses the others in one line.

One world of 2 gloo ranks trains each family at tp=2 (GRPO's loss, one optimizer step; half of the families on
packed rows with shared prompts, the others on padded rows); a world of 4
ranks trains the MoE families at dp_shard=2 x tp=2 x ep=2 (tp x ep) and four others at dp_shard=2 x tp=2 (their
tensor-parallel weights FSDP2-sharded too), with activation checkpointing; one process trains the same. A tp=2
checkpoint of each family loads into one process as the same weights. The logprobs before the step agree to
1e-5, and so do the weights after it, to 2e-5 of each tensor's largest step: AdamW with an epsilon far above the
gradients (lr = eps = 100, no clipping) moves each weight by -g (1 - |g| / 100), so the step compares every
parameter's gradient, not only its sign. Most families keep the tiny models' single key/value head (each rank
then keeps its query heads' kv head); Mixtral and Gemma 2 have two (split by heads). Final-logit soft-caps and
scalings are set neutral here: the chunked LM head refuses them until it applies them (another part of issue 42).
"""

import sys
import traceback
from pathlib import Path

import _shards
import pytest
import torch
from test_fsdp2_worker import launch
from test_torch_backend import loss_fn
from transformers import AutoConfig

from reinforge.algorithms.losses import token_mean
from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.fsdp2 import FSDP2Strategy
from reinforge.training.heads import LogprobHead
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig, check_layout
from reinforge.training.parallel.planner import candidate_layouts, shape_of_config
from reinforge.training.parallel.tensor_plan import TP_REFUSED

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_families import FAMILIES, VOCAB, build  # noqa: E402

pytestmark = pytest.mark.xdist_group("fsdp2_worker")
SPLIT = [name for name in FAMILIES if name not in TP_REFUSED]
TWO_KV_HEADS = ("mixtral", "gemma2")  # split by heads; the others share their one kv head over the ranks
# MoE families whose experts expert parallelism splits (not gpt-oss's: biases) run at dp2 x tp2 x ep2 on 4 ranks,
# some others at dp2 x tp2 (their tensor-parallel weights FSDP2-sharded as well)
EXPERT_PARALLEL = [name for name in SPLIT if FAMILIES[name].moe and name != "gpt_oss"]
FOUR_RANKS = {name: dict(dp_shard=2, tp=2, ep=2 if name in EXPERT_PARALLEL else 1) for name in SPLIT}
# the rows' layout: packed with shared prompts for eight families (segment attention: windows, soft-caps, sinks), padded
# for the others
PACKED = ("qwen3", "mixtral", "gemma2", "gemma3", "phi3", "olmo2", "gpt_oss", "deepseek_v3")
ROWS = {
    name: dict(sequence_packing=True, share_prompts=True) if name in PACKED else dict(sequence_packing=False)
    for name in FAMILIES
}
# {layout: (ranks, {family: training.parallel})}
LAYOUTS = {
    "tp2": (2, {name: dict(tp=2) for name in SPLIT}),
    "dp2tp2": (4, {name: FOUR_RANKS[name] for name in [*EXPERT_PARALLEL, "phi3", "olmo2", "gemma3", "gpt_oss"]}),
}
# each rank's rows of the embedding [449, 64]: 225 + 224 over tp, then over dp_shard (225 as 113 + 112)
VOCABULARY_ROWS = {"tp2": [225, 224], "dp2tp2": [113, 112, 112, 112]}
# an AdamW step that is a gradient step: -lr g / (|g| + eps) = -g (1 - |g| / eps) with lr = eps
STEP = OptimizerConfig(lr=100.0, adam_eps=100.0, max_grad_norm=0.0)


def make_batch():
    """4 rows, 2 prompts shared by pairs, responses of varied length; noise for the old logprobs."""
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(4):
        if row % 2 == 0:
            prompt = torch.randint(3, VOCAB, (5 + row,), generator=gen).tolist()
        response = torch.randint(3, VOCAB, (4 + 3 * row,), generator=gen).tolist()
        trajectories.append(Trajectory(prompt, response, [0.0] * len(response), False, 0.0, row // 2, "math"))
    batch = collate(trajectories, torch.randn(4, generator=gen).tolist(), pad_token_id=0)
    return batch, 0.3 * torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask


def make_backend(strategy, model_dir, training):
    family = Path(model_dir).name
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=2, global_batch_size=4, **(ROWS[family] | training)),
        STEP,
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(temperature=0.7),
        strategy=strategy,
    )


def run_family(strategy, model_dir, training, checkpoint=None):
    """Logprobs, metrics and each weight's step of one optimizer step; with `checkpoint`, the state after it
    saved there (and the weights returned)."""
    backend = make_backend(strategy, model_dir, training)
    batch, noise = make_batch()
    before = {name: weight.clone() for name, weight in backend.named_weights()}
    # what this rank holds (before a forward: FSDP2 leaves the root's parameters whole after one) and receives
    held, seen = _shards.held(backend.model), _shards.watch_inputs(backend.model)
    logprobs = backend.logprobs(batch)
    shards = {"held": held, "rows": _shards.micro_batch_rows(backend, batch), "inputs": _shards.inputs_record(seen)}
    batch.old_logprobs = logprobs + noise  # near the policy's: the clip is active on some tokens only
    metrics = backend.train_step(batch, lambda *args: loss_fn(token_mean, 0.0, *args))
    after = dict(backend.named_weights())
    if checkpoint is not None:
        backend.save_state(checkpoint)
    backend.shutdown()
    steps = {name: weight - before[name] for name, weight in after.items()}
    result = {"logprobs": logprobs, "metrics": metrics, "steps": steps} | shards
    return result | ({"after": after} if checkpoint else {})


def run_rank(rank, world_size, ports, model_dirs, out_dir, layout):
    torch.set_num_threads(1)
    results = {}
    _, families = LAYOUTS[layout]
    for port, (name, parallel) in zip(ports, families.items(), strict=True):
        strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
        training = dict(
            parallel=ParallelConfig(**parallel), backend="fsdp2", num_workers=world_size, collective_timeout_s=60
        )
        training["activation_checkpointing"] = layout == "dp2tp2"  # the recompute runs the plan's hooks again
        try:  # one family's failure is its own test's, not the others'
            checkpoint = out_dir / f"checkpoint_{name}" if layout == "tp2" else None
            results[name] = run_family(strategy, model_dirs[name], training, checkpoint)
        except Exception:
            results[name] = traceback.format_exc()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


def _edit(name):
    def edit(config):
        if name in TWO_KV_HEADS:
            config.num_key_value_heads = 2

    return edit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp_families")
    model_dirs = {name: build(name, base / name, edit=_edit(name)) for name in SPLIT}
    one = {name: run_family(None, model_dirs[name], {}) for name in SPLIT}
    ranks = {}
    for layout, (world_size, families) in LAYOUTS.items():
        out_dir = base / layout
        out_dir.mkdir()
        ranks[layout] = launch(
            world_size, model_dirs, out_dir, layout, target=run_rank, timeout_s=600, num_ports=len(families)
        )
    return one, ranks, model_dirs, base


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("layout, family", [(key, name) for key, (_, names) in LAYOUTS.items() for name in names])
def test_tensor_parallel_equals_one_process(runs, layout, family):
    one, ranks, _, _ = runs
    reference = one[family]
    for rank, result in enumerate(ranks[layout]):
        ranked = result[family]
        assert not isinstance(ranked, str), f"rank {rank} failed:\n{ranked}"
        torch.testing.assert_close(ranked["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)
        for metric in ("loss", "grad_norm", "entropy"):
            assert abs(ranked["metrics"][metric] - reference["metrics"][metric]) <= 1e-5, (rank, metric)
        assert ranked["steps"].keys() == reference["steps"].keys()
        worst = max(relative(ranked["steps"][n], step) for n, step in reference["steps"].items() if step.any())
        difference = (ranked["logprobs"] - reference["logprobs"]).abs().max()
        print(f"{layout} {family} rank {rank}: logprobs {difference:.2e}, steps (gradients) max relative {worst:.2e}")
        for name, step in reference["steps"].items():
            torch.testing.assert_close(ranked["steps"][name], step, atol=2e-5 * step.abs().max(), rtol=0, msg=name)
    moved = [name for name, step in reference["steps"].items() if step.abs().max() > 0]
    assert len(moved) >= 0.9 * len(reference["steps"]), "most weights get a gradient"


@pytest.mark.parametrize("layout, family", [(key, name) for key, (_, names) in LAYOUTS.items() for name in names])
def test_each_rank_holds_its_shards_and_gets_its_rows(runs, layout, family):
    """Every parameter's placements and local shape on every rank as the layout says: projections, vocabulary and
    experts split over tp (the vocabulary of 449 as 225 + 224), experts over ep, all over FSDP2's dp_shard; tp
    peers get the same rows, dp ranks different ones (_shards.py)."""
    one, ranks, model_dirs, _ = runs
    shapes = {name: shape for name, (_, _, shape, _) in one[family]["held"].items()}
    assert one[family]["held"] == _shards.plain(shapes)
    world_size, families = LAYOUTS[layout]
    grid = _shards.Layout(**{"dp_shard": 1, **families[family]})
    config = AutoConfig.from_pretrained(model_dirs[family]).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for rank, result in enumerate(ranks[layout]):
        ranked = result[family]
        assert not isinstance(ranked, str), f"rank {rank} failed:\n{ranked}"
        expected = _shards.expected_held(shapes, grid, rank, head_dim, transposed=family == "gpt_oss")
        _shards.assert_held(ranked["held"], expected, f"{layout} {family} rank {rank}")
        assert ranked["held"]["model.embed_tokens.weight"][3] == (VOCABULARY_ROWS[layout][rank], 64)
    routing = [result[family] for result in ranks[layout]]
    _shards.assert_routing([r["rows"] for r in routing], [r["inputs"] for r in routing], grid, len(make_batch()[0]))


@pytest.mark.parametrize("family", SPLIT)
def test_a_tp2_checkpoint_resumes_in_one_process_with_its_weights(runs, family):
    """DCP's checkpoint of the tp=2 ranks (their DTensors) loads into one process as the same full weights."""
    _, ranks, model_dirs, base = runs
    tp2 = ranks["tp2"][0][family]
    assert not isinstance(tp2, str), tp2
    backend = make_backend(None, model_dirs[family], {})
    backend.load_state(base / "tp2" / f"checkpoint_{family}")
    loaded = dict(backend.named_weights())
    backend.shutdown()
    assert loaded.keys() == tp2["after"].keys()
    for name, weight in tp2["after"].items():
        torch.testing.assert_close(loaded[name], weight, atol=0, rtol=0, msg=name)


def test_a_family_tensor_parallelism_cannot_split_is_refused_in_one_line():
    config = FAMILIES["nemotron_h"].config()
    with pytest.raises(ConfigError, match=r"does not support nemotron_h: its Mamba-2 .*; set training.parallel.tp=1"):
        check_layout(ParallelConfig(tp=2), config)
    with pytest.raises(ConfigError, match="tensor-parallel plan .*, and gpt2 has none; set training.parallel.tp=1"):
        check_layout(ParallelConfig(tp=2), AutoConfig.for_model("gpt2"))
    moe = FAMILIES["qwen3_moe"].config()  # moe_intermediate_size 32: tp=3 divides neither it nor the 2 heads
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(MLP columns\) \(32\); the nearest valid tp is 2"):
        check_layout(ParallelConfig(tp=3), moe)
    nemotron = shape_of_config(config.to_dict() | dict(num_hidden_layers=3))  # parallel=auto: no tp for it
    assert {layout.tp for layout in candidate_layouts(nemotron, 8)} == {1}
    llama = shape_of_config(FAMILIES["llama"].config().to_dict() | dict(num_key_value_heads=2))
    assert {layout.tp for layout in candidate_layouts(llama, 8)} == {1, 2}
    kv_one = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=1, intermediate_size=96)
    check_layout(ParallelConfig(tp=2), kv_one)  # one kv head, shared by each rank's query heads
