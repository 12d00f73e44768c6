"""Pipeline parallelism (training/parallel/pipeline.py): the stage split, and pipelined training on real gloo ranks
equal to one process.

The split: a Qwen2 with tied embeddings cut into 2 and 3 stages, its stages chained (each decoder starting from
the previous stage's output) give the whole model's logits, each stage holding only its own parameters under one
process's names.

Training: a Qwen2 of 4 layers, 4 heads, 2 key/value heads, a vocabulary of 97 and tied embeddings trains 3
optimizer steps on GRPO's loss (packed, prompts shared) and SFT's NLL (one sequence per row) in one process and at
pp=2 (1F1B; GPipe with 4 micro-batches merged into 2), pp=2 x dp_shard=2 and pp=2 x tp=2, GRPO on sequences 4 times
as long at pp=2 x cp=2 (each stage passing its chunk of the rows on), and as PPO's critic (a value head) at pp=2; a
Qwen3-MoE of 4 layers and 4 experts at pp=2 x ep=2. The logprobs (values), loss, gradient
norm and entropy on every rank and every weight after the steps agree to 1e-5, and each rank holds exactly its
stage's parameters. One module fixture spawns a world of 2 ranks and one of 4 once.
"""

import copy
from functools import partial

import pytest
import torch
from test_fsdp2_worker import launch
from test_tensor_parallel import make_batch, value_loss
from test_torch_backend import loss_fn
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from reinforge.algorithms.losses import token_mean
from reinforge.algorithms.sft import nll_loss
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig, MoeConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.critic import VALUE_HEAD
from reinforge.training.fsdp2 import FSDP2Strategy, gather
from reinforge.training.heads import LogprobHead
from reinforge.training.numerics import local
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.layout import ParallelConfig, check_layout
from reinforge.training.parallel.pipeline import check_staged_moe, pipeline_plan, split_stage, stage_layers

NUM_STEPS = 3
METRICS = ("loss", "grad_norm", "entropy")
GRPO = partial(loss_fn, token_mean, 0.0)
SHARED = dict(sequence_packing=True, share_prompts=True)
# scenario: (model, training settings, loss)
SCENARIOS = {"grpo": ("qwen2", SHARED, GRPO), "sft": ("qwen2", dict(sequence_packing=False), nll_loss)}
SCENARIOS["moe_grpo"] = ("qwen3_moe", SHARED, GRPO)
SCENARIOS["critic"] = ("qwen2", SHARED, "value")  # PPO's critic: a value head on the last stage
SCENARIOS["grpo_long"] = ("qwen2", SHARED, GRPO)  # sequences 4 times as long, for context parallelism
SCALES = {"grpo_long": 4}
# (key, ranks, training.parallel, scenarios); ep borrows dp_shard's ranks
LAYOUTS = (
    ("pp2_1f1b", 2, dict(pp=2), ("grpo", "sft", "critic")),
    ("pp2_gpipe", 2, dict(pp=2, pp_schedule="GPipe", pp_microbatches=2), ("grpo", "sft")),  # 4 merged into 2
    ("pp2_dp2", 4, dict(pp=2, dp_shard=2), ("grpo", "sft")),
    ("pp2_tp2", 4, dict(pp=2, tp=2), ("grpo", "sft")),
    ("pp2_ep2", 4, dict(pp=2, dp_shard=2, ep=2), ("moe_grpo",)),
    ("pp2_cp2", 4, dict(pp=2, cp=2), ("grpo_long",)),
)
pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def tiny_qwen2(num_layers=4):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


def tiny_qwen3_moe():
    """4 layers of 4 experts (top-2), untied embeddings."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    return Qwen3MoeForCausalLM(config).eval()


MODELS = {"qwen2": tiny_qwen2, "qwen3_moe": tiny_qwen3_moe}


def test_stage_layers_are_contiguous_and_earlier_stages_take_the_extra_layer():
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]


def test_pp_microbatches_split_or_merge_the_plan_keeping_every_sequence_once():
    plan = [[[0, 1], [2]], [[3]], [[4], [5]], [[6, 7]]]
    merged = pipeline_plan(plan, 2)
    assert merged == [[[0, 1], [2], [3]], [[4], [5], [6, 7]]]
    split = pipeline_plan(plan, 6)
    assert len(split) == 6 and sorted(i for micro in split for row in micro for i in row) == list(range(8))


def test_what_pipeline_parallelism_cannot_do_is_a_one_line_error():
    config = Qwen2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    check_layout(ParallelConfig(pp=2, cp=2), config)  # each stage passes its chunk on to the same cp rank
    with pytest.raises(ConfigError, match="vision-language model is not supported"):
        check_layout(ParallelConfig(pp=2), config, vision=True)
    with pytest.raises(ConfigError, match="set training.parallel.pp <= 4"):
        check_layout(ParallelConfig(pp=5), config)
    with pytest.raises(ConfigError, match="set pp_microbatches >= 4"):
        check_layout(ParallelConfig(pp=4, pp_microbatches=2), config)
    check_layout(ParallelConfig(pp=4, pp_microbatches=2, pp_schedule="GPipe"), config)
    with pytest.raises(ConfigError, match="aux_loss_coef > 0 are not supported with training.parallel.pp > 1"):
        check_staged_moe(MoeConfig(aux_loss_coef=0.01))
    check_staged_moe(MoeConfig())


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_chained_equal_the_whole_model(pp):
    whole = tiny_qwen2(num_layers=5)
    ids = torch.randint(2, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    expected = whole(input_ids=ids, logits_to_keep=0).logits
    names = dict(whole.named_parameters())
    stages = [copy.deepcopy(whole) for _ in range(pp)]
    hidden, kept = None, []
    for index, model in enumerate(stages):
        stage = split_stage(model, index, pp)
        stage.received = hidden
        logits = model(input_ids=ids, logits_to_keep=0).logits
        stage.received, hidden = None, stage.take()
        own = {name for name, _ in model.named_parameters()}
        layers = {int(name.split(".")[2]) for name in own if name.startswith("model.layers.")}
        assert layers == set(stage.layers) and own <= set(names) | {"lm_head.weight"}
        assert ("model.embed_tokens.weight" in own) == (index == 0)
        assert ("model.norm.weight" in own) == ("lm_head.weight" in own) == (index == pp - 1)
        kept.append(own)
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    assert set().union(*kept) == set(names) | {"lm_head.weight"}  # every parameter on some stage (the tie copied)
    assert sum(len(own) for own in kept) == len(names) + 1


def run_scenario(strategy, model_dirs, scenario, parallel=None):
    torch.manual_seed(0)
    model, training, loss = SCENARIOS[scenario]
    if parallel is not None:
        training = dict(training, parallel=ParallelConfig(**parallel), backend="fsdp2", num_workers=strategy.world_size)
    backend = Backend(
        ModelConfig(name_or_path=str(model_dirs[model])),
        TrainingConfig(micro_batch_size=2, global_batch_size=8, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=VALUE_HEAD if loss == "value" else LogprobHead(temperature=0.7),
        strategy=strategy,
    )
    loss = value_loss if loss == "value" else loss
    batch = make_batch(SCALES.get(scenario, 1))
    logprobs = backend.logprobs(batch)
    metrics = [backend.train_step(batch, loss) for _ in range(NUM_STEPS)]
    metrics.append(backend.evaluate(batch, loss))  # forward only, in eval mode (validation)
    own = {name: tuple(local(p).shape) for name, p in backend.model.named_parameters()}  # this rank's shards
    # this stage's weights whole (a collective of the stage's ranks): the stages together hold every weight
    weights = gather(backend.model.state_dict(keep_vars=True)) if parallel else dict(backend.named_weights())
    backend.shutdown()
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights, "own": own}


def world_runs(world_size):
    """(layout, its training.parallel, scenario) of every run of a world of `world_size` ranks."""
    return [(key, parallel, s) for key, size, parallel, scenarios in LAYOUTS if size == world_size for s in scenarios]


def run_rank(rank, world_size, ports, model_dirs, out_dir):
    """Every run of the world, each on a process group (and port) of its own."""
    torch.set_num_threads(1)
    results = {}
    for port, (key, parallel, scenario) in zip(ports, world_runs(world_size), strict=True):
        strategy = FSDP2Strategy(rank, world_size, "127.0.0.1", port)
        results[key, scenario] = run_scenario(strategy, model_dirs, scenario, parallel)
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"one": one process's results per scenario; 2 and 4: every rank's per (layout, scenario)}."""
    base = tmp_path_factory.mktemp("pp")
    model_dirs = {name: base / name for name in MODELS}
    for name, make in MODELS.items():
        make().save_pretrained(model_dirs[name])
    results = {"one": {scenario: run_scenario(None, model_dirs, scenario) for scenario in SCENARIOS}}
    for world_size in (2, 4):  # one world of each size runs its layouts one after another
        out_dir = base / f"world{world_size}"
        out_dir.mkdir()
        ports = len(world_runs(world_size))
        results[world_size] = launch(world_size, model_dirs, out_dir, target=run_rank, timeout_s=600, num_ports=ports)
    return results


def stage_of(rank, world_size):
    return rank // (world_size // 2)  # pp outermost in the mesh


@pytest.mark.parametrize("layout, scenario", [(key, scenario) for key, _, _, runs in LAYOUTS for scenario in runs])
def test_pipelined_training_equals_one_process(runs, layout, scenario):
    one = runs["one"][scenario]
    assert one["metrics"][0]["grad_norm"] > 0
    ranks = [result[layout, scenario] for result in runs[next(size for key, size, _, _ in LAYOUTS if key == layout)]]
    for rank, ranked in enumerate(ranks):
        torch.testing.assert_close(ranked["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        for step in range(NUM_STEPS + 1):  # and the evaluation after them
            for name in [name for name in METRICS if name in one["metrics"][step]]:
                assert abs(ranked["metrics"][step][name] - one["metrics"][step][name]) <= 1e-5, (rank, step, name)
        stage = stage_of(rank, len(ranks))
        layers = {int(name.split(".")[2]) for name in ranked["own"] if name.startswith("model.layers.")}
        assert layers == set(stage_layers(4, 2, stage)), (rank, sorted(layers))
        assert ("model.embed_tokens.weight" in ranked["own"]) == (stage == 0)
        assert ("lm_head.weight" in ranked["own"]) == ("model.norm.weight" in ranked["own"]) == (stage == 1)
        if scenario.startswith("moe"):  # each rank holds half its layers' experts (ep=2)
            experts = [shape for name, shape in ranked["own"].items() if name.endswith("experts.down_proj")]
            assert len(experts) == 2 and all(shape[0] == 2 for shape in experts), ranked["own"]
        for name, weight in ranked["weights"].items():
            torch.testing.assert_close(weight, one["weights"][name], atol=1e-5, rtol=0, msg=name)
    stages = [ranks[0]["weights"], ranks[-1]["weights"]]
    assert set(stages[0]) | set(stages[1]) == set(one["weights"])
    initial = MODELS[SCENARIOS[scenario][0]]().state_dict()
    for name, weight in one["weights"].items():
        if name in initial:  # (a value head is new)
            assert (weight - initial[name]).abs().max() > 0, f"{name} was not updated"
