"""The planner with pipeline parallelism and tp x ep (training/parallel/planner.py, plan_layouts.py): a stage's memory
and the bubble by hand, every printed candidate through the run's own layout check, and the two large reference
models (Qwen3-235B-A22B on 4 x 8 x 80 GB, Llama-3.1-405B on 32 x 8 x 80 GB at 8K) with their layouts checked on a
tiny model of the same family."""

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from reinforge.cli import main
from reinforge.errors import ConfigError
from reinforge.loops.dry_run import text_config_of
from reinforge.training.parallel.engine_layout import check_engine_layout
from reinforge.training.parallel.layout import ParallelConfig, check_layout
from reinforge.training.parallel.plan_layouts import (
    bubble,
    expert_network_ratio,
    pipeline_ratio,
    relative_step_time,
    stage_layer_counts,
)
from reinforge.training.parallel.planner import (
    GIB,
    KNOWN_MODELS,
    Layout,
    ModelShape,
    Workload,
    estimate,
    memory_terms,
    model_shape,
    plan,
)

TINY = ModelShape(8, 2, 2, 1, 16, 32, tie_word_embeddings=True, attention_bias=True)


def test_stage_layers_bubble_and_the_speed_of_a_pipeline_by_hand():
    assert stage_layer_counts(94, 4) == [24, 24, 23, 23] and stage_layer_counts(126, 32) == [4] * 30 + [3] * 2
    assert bubble(4, 12) == 3 / 15 and bubble(2, 3) == 1 / 4 and bubble(1, 5) == 0
    # without a shape the pipeline costs its bubble only: the step takes (m + pp - 1) / m of its time
    assert relative_step_time(Layout(1, 1, 1, 1, pp=4), False, workload=Workload(10, pp_microbatches=12)) == 15 / 12
    assert Workload(10).microbatches(4) == 16  # 4 per stage by default
    # a boundary's activations and gradients against the stage's compute: 2 x H 8 x b 2 B / 50 GB/s against
    # 6 x 608 (the active parameters of one layer of TINY: 1480 - the root 264 = 1216, over 2 stages) / 400 TFLOP/s
    ratio = pipeline_ratio(TINY, Layout(1, 1, 1, 1, pp=2), Workload(10))
    assert ratio == pytest.approx((2 * 8 * 2 / 50e9) / (6 * 608 / 400e12))


def test_a_stage_holds_its_layers_its_end_of_the_model_and_the_micro_batches_in_flight():
    """TINY (H 8, 2 layers of 608 parameters, V 32 tied, root 256 + norm 8) at pp=2 on GPU (b = 2), 10 tokens, m = 3.
    Stage 0: a layer and the embedding, 608 + 256 = 864 parameters; stage 1: a layer, the final norm and its own copy
    of the tied head, 608 + 264 = 872. Activations per token and layer 344 (test_planner.py); 1F1B holds min(3, 2 - s)
    micro-batches: 2 on stage 0, 1 on stage 1; GPipe all 3; a micro-batch's layer keeps 10 x 344 = 3440 and the
    segment attention's mask 10 x 10 x 2 = 200. Receive buffers of every micro-batch, m x T x H x b = 3 x 10 x 8 x
    2 = 480 per direction (stage 0 receives gradients only, stage 1 activations only).
    Stage 0: params 4 x 864 = 3456, gathered 2 x (608 + 256 + 608 + 256) = 3456, activations 2 x 3640 + 480 =
    7760, no logits. Stage 1: params 3488, gathered 2 x (608 + 264 + 608 + 264) = 3488, activations 3640 + 480 =
    4120, logits 10 x 32 x 14 + 10 x 8 x 10 = 5280. Totals 25,040 and 26,840: the last stage counts."""
    layout, workload = Layout(1, 1, 1, 1, pp=2), Workload(10, runtime_gib=0.0, pp_microbatches=3, generation="none")
    first = memory_terms(TINY, layout, workload, False, stage=0)
    last = memory_terms(TINY, layout, workload, False, stage=1)
    assert first == dict(
        params=3456, gathered=3456, grads=3456, optimizer=6912, activations=7760, logits=0, reference=0, runtime=0
    )
    assert last == dict(
        params=3488, gathered=3488, grads=3488, optimizer=6976, activations=4120, logits=5280, reference=0, runtime=0
    )
    worst = estimate(TINY, layout, workload, False, 1e15)
    assert (worst.stage, worst.total) == (1, 26840)
    gpipe = Workload(10, runtime_gib=0.0, pp_microbatches=3, pp_schedule="GPipe")
    assert memory_terms(TINY, layout, gpipe, False, stage=0)["activations"] == 3 * 3640 + 480
    # checkpointed: the held micro-batches' layer inputs 2 x 10 x 8 x 2 = 320, one layer recomputed 3640, buffers 480
    assert memory_terms(TINY, layout, workload, True, stage=0)["activations"] == 320 + 3640 + 480


def test_tp_with_ep_costs_the_network_only_when_an_expert_group_leaves_the_node():
    """Qwen3-235B-A22B at ep 32 over 4 nodes: 24 of a token's 32 destinations are on other nodes; its top-8 copies of
    H 4096 in bf16 go there and back in the forward and backward, 4 x 8 x 4096 x 2 x 24/32 = 196,608 B per token and
    layer at 50 GB/s, against 6 x its active parameters per layer at 400 TFLOP/s."""
    shape = KNOWN_MODELS["Qwen3-235B-A22B"]
    assert expert_network_ratio(shape, Layout(1, 8, 1, 1, 8), 8) == 0  # ep 8 on one node's links
    active = (shape.active_parameters() - shape.root_parameters()) / 94
    expected = (196_608 / 50e9) / (6 * active / 400e12)
    assert expert_network_ratio(shape, Layout(1, 32, 1, 1, 32), 8) == pytest.approx(expected)


@pytest.mark.parametrize("generation", ["colocated", "separate"])
def test_every_candidate_the_planner_prints_is_one_the_run_accepts(generation):
    """Every row of `reinforge plan` (each model it knows, 1 to 128 GPUs of 8 per node, with pp where there are
    nodes to stage): its training layout passes the ranks' own check (layout.py `check_layout`, on a transformers
    config of the model's sizes) and its engines the run's engine rules (engine_layout.py)."""
    checked, pipelines = 0, 0
    for name, shape in KNOWN_MODELS.items():
        text_config = text_config_of(shape)
        for gpus in (1, 2, 8, 16, 128):
            for e in plan(shape, gpus, 80, Workload(4096, generation=generation)).estimates:
                if e.activation_checkpointing:
                    continue  # the same layout as its row without
                check_layout(ParallelConfig(**e.layout.fields()).resolved(gpus), text_config)
                heads = dict(heads=shape.num_attention_heads, kv_heads=shape.num_key_value_heads)
                check_engine_layout(e.engine_layout, gpus, gpus_per_node=8, on_gpu=True, **heads)
                assert e.engine_layout.colocate == (generation == "colocated")
                checked, pipelines = checked + 1, pipelines + (e.layout.pp > 1)
    assert checked > 500 and pipelines > 100, (checked, pipelines)


def test_the_planner_refuses_a_layout_the_run_would_refuse():
    """The check the test above relies on can fail: a pp over the layer count, a tp over the key/value heads."""
    with pytest.raises(ConfigError, match="need at least one decoder layer each"):
        check_layout(ParallelConfig(pp=4), text_config_of(TINY))
    with pytest.raises(ConfigError, match="tp=4"):
        check_layout(ParallelConfig(tp=4), text_config_of(TINY))


def test_the_two_large_reference_models_have_their_public_sizes():
    """Qwen3-235B-A22B (config.json: 94 layers, H 4096, 64 heads of 128, 4 kv heads, 128 experts of width 1536,
    top-8, V 151936, untied): a layer 8192 x 4096 x 2 + 512 x 4096 x 2 (q, o, k, v) = 71,303,168, router 524,288,
    experts 128 x 3 x 4096 x 1536 = 2,415,919,104, norms 8,448: 2,487,755,008; root 2 x 151,936 x 4096 + 4096 =
    1,244,663,808; total 94 x that + root = 235,093,634,560 (235B), active 235,093,634,560 - 94 x 2,415,919,104 x
    120/128 = 22,190,763,520 (22B). Llama-3.1-405B (126 layers, H 16384, 128 heads, 8 kv, I 53248, V 128256):
    405,853,388,800."""
    qwen, llama = model_shape("Qwen/Qwen3-235B-A22B"), model_shape("meta-llama/Llama-3.1-405B-Instruct")
    assert qwen == KNOWN_MODELS["Qwen3-235B-A22B"] and llama == KNOWN_MODELS["Llama-3.1-405B"]
    assert qwen.layer_parameters() == 2_487_755_008 and qwen.root_parameters() == 1_244_663_808
    assert qwen.parameters() == 235_093_634_560 and qwen.active_parameters() == 22_190_763_520
    assert llama.parameters() == 405_853_388_800
    assert model_shape("meta-llama/Llama-3.3-70B-Instruct") == KNOWN_MODELS["Llama-3-70B"]


# (name, GPUs, workload, the layout docs/distributed.md names): the two large cases
LARGE_CASES = {
    "Qwen3-235B-A22B": (32, Workload(8192, lora_rank=16, generation="separate"), Layout(2, 8, 1, 1, ep=8, pp=2)),
    "Llama-3.1-405B": (256, Workload(8192, generation="none"), Layout(1, 2, 2, 2, pp=32)),
}


@pytest.mark.parametrize("name", LARGE_CASES)
def test_the_large_reference_cases_name_a_layout_that_a_tiny_model_of_their_family_accepts(name, capsys):
    """The planner's choice for each large case (docs/distributed.md's worked examples) keeps the 10% margin; its
    pp, tp, cp and ep degrees pass check_layout on a tiny model of the same family built by transformers, with
    layer, head and expert counts scaled so that they divide (2 layers per stage, 2 heads per tp x cp rank, 2
    experts per ep rank)."""
    gpus, workload, named = LARGE_CASES[name]
    result = plan(KNOWN_MODELS[name], gpus, 80, workload)
    assert result.choice is not None and result.choice.layout == named, result.reason
    assert max(result.choice.total, result.choice.engine_total) <= 0.9 * 80 * GIB
    layout = result.choice.layout
    sizes = dict(
        vocab_size=64, hidden_size=16 * layout.tp * layout.cp, num_hidden_layers=2 * layout.pp,
        num_attention_heads=2 * layout.tp * layout.cp, num_key_value_heads=layout.tp, intermediate_size=8 * layout.tp,
    )  # fmt: skip
    if name.startswith("Qwen3"):
        config = Qwen3MoeConfig(
            **sizes, head_dim=8, num_experts=2 * layout.ep, num_experts_per_tok=2, moe_intermediate_size=4 * layout.tp
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    parallel = ParallelConfig(**layout.fields()).resolved(gpus)
    check_layout(parallel, model.config)
    assert parallel.pp * parallel.dp_replicate * parallel.dp_shard * parallel.tp * parallel.cp == gpus
    argv = ["plan", "--model", name, "--gpus", str(gpus), "--gpu-memory", "80", "--seq-len", "8192"]
    argv += ["--lora", "16", "--generation", "separate"] if workload.lora_rank else ["--generation", "none"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"choice: {layout}, activation checkpointing" in out and "bubble      = (pp" in out


def test_a_full_fine_tune_of_the_235b_on_4_nodes_and_a_405b_engine_are_one_line_each():
    """16 B of weights, gradients and AdamW per parameter are 235e9 x 16 / 32 = 109.5 GiB per GPU before anything
    else; a 405B engine's bf16 weights are 405.9e9 x 2 / 8 = 94.5 GiB per GPU at the largest tp of one node."""
    full = plan(KNOWN_MODELS["Qwen3-235B-A22B"], 32, 80, Workload(8192, generation="none"))
    assert full.choice is None and "use more GPUs" in full.reason
    engine = plan(KNOWN_MODELS["Llama-3.1-405B"], 256, 80, Workload(8192))
    assert engine.choice is None and "the generation engine alone needs" in engine.reason
    assert "\n" not in engine.reason and "--generation none" in engine.reason


def test_the_pipeline_options_of_reinforge_plan(capsys):
    """--pp-microbatches sets m (the bubble and the receive buffers), --pp-schedule GPipe holds all m on a stage; a
    count below 1 is one line."""
    argv = ["plan", "--model", "Llama-3-70B", "--gpus", "128", "--gpu-memory", "80", "--seq-len", "16384"]
    assert main([*argv, "--pp-microbatches", "0"]) == 2
    assert "--pp-microbatches 0: give 1 or more" in capsys.readouterr().err
    shape, workload = KNOWN_MODELS["Llama-3-70B"], Workload(16384, pp_schedule="GPipe", pp_microbatches=8)
    one_f_one_b = Workload(16384, pp_microbatches=8)
    layout = Layout(1, 8, 8, 1, pp=2)
    gpipe = memory_terms(shape, layout, workload, True, stage=1)["activations"]
    assert gpipe > memory_terms(shape, layout, one_f_one_b, True, stage=1)["activations"]
    assert main([*argv, "--pp-microbatches", "32", "--pp-schedule", "GPipe"]) == 0
