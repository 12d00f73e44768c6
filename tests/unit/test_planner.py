"""The layout planner (training/parallel/planner.py, `reinforge plan`): its memory terms against hand-computed bytes and
transformers' own parameter counts, its candidate layouts, the three named examples, the measured H200 peaks,
and a measured CPU peak."""

import json
import subprocess
import sys

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from reinforge.cli import main
from reinforge.errors import ConfigError
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.paths import PROJECT_ROOT
from reinforge.training.parallel.planner import (
    GIB,
    KNOWN_MODELS,
    Layout,
    ModelShape,
    Workload,
    auto_layout,
    candidate_layouts,
    choose,
    estimate,
    memory_terms,
    model_shape,
    plan,
)

TINY = ModelShape(8, 2, 2, 1, 16, 32, tie_word_embeddings=True, attention_bias=True)
TINY_CONFIG = dict(
    hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16
)


def test_parameter_counts_are_those_of_the_transformers_models(tmp_path):
    """Qwen2 (q/k/v biases, tied head) and Llama (no biases, untied head) built by transformers."""
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, tie_word_embeddings=True, **TINY_CONFIG))
    assert TINY.parameters() == sum(p.numel() for p in qwen.parameters()) == 1480
    llama_config = LlamaConfig(vocab_size=32, tie_word_embeddings=False, **TINY_CONFIG)
    llama = LlamaForCausalLM(llama_config)
    llama_config.save_pretrained(tmp_path)
    assert model_shape(str(tmp_path)).parameters() == sum(p.numel() for p in llama.parameters())
    # the 1.5B of docs/benchmarks.md's H200 run had 1,543,714,304 parameters
    assert model_shape("Qwen/Qwen2.5-1.5B").parameters() == 1_543_714_304
    assert model_shape("meta-llama/Llama-3.3-70B-Instruct") == KNOWN_MODELS["Llama-3-70B"]


def test_memory_terms_of_a_tiny_config_by_hand():
    """H 8, 2 layers, 2 heads of 4 (Q 8), 1 kv head (kv width 4), I 16, V 32, tied, biases.
    A layer: q 64 + k 32 + v 32 + o 64 + MLP 3 x 8 x 16 = 384 + biases 16 + norms 16 = 608; the root: 32 x 8 + 8 = 264;
    P = 2 x 608 + 264 = 1480. dp_shard 2 on GPU (b = 2), 10 tokens:
    params 4 x 1480 / 2 = 2960, grads 2960, optimizer 8 x 1480 / 2 = 5920,
    gathered 2 x (2 x 608 + 264 + 608 + 264) = 4704;
    activations per token per layer: norms 2 x 8 x (4 + 2 x 2) = 128, attention 5 x 8 x 2 + 4 x 2 = 88,
    MLP 4 x 16 x 2 = 128: 344; the segment attention's mask 10 x 10 x 2 = 200 per layer; without checkpointing
    2 x (10 x 344 + 200) = 7280, with 2 x 10 x 8 x 2 + 10 x 344 + 200 = 3960;
    logits 10 x 32 x (2 + 12) + 10 x 8 x (4 + 6) = 5280."""
    layout, workload = Layout(1, 2, 1, 1), Workload(seq_len=10, runtime_gib=0.0, kl=True)
    terms = memory_terms(TINY, layout, workload, activation_checkpointing=False)
    assert terms == dict(
        params=2960, gathered=4704, grads=2960, optimizer=5920, activations=7280, logits=5280, reference=2960, runtime=0
    )
    assert memory_terms(TINY, layout, workload, activation_checkpointing=True)["activations"] == 3960
    # LoRA rank 2 on every linear: rank x (in + out) per layer = 2 x (16 + 12 + 12 + 16 + 24 + 24 + 24) = 256, x 2
    # layers = 512 trained parameters; the base still in fp32; no reference (the adapters are switched off)
    lora = memory_terms(TINY, layout, Workload(10, lora_rank=2, kl=True), False)
    assert (lora["params"], lora["grads"], lora["optimizer"], lora["reference"]) == (
        4 * (1480 + 512) / 2, 4 * 512 / 2, 8 * 512 / 2, 0
    )  # fmt: skip
    # fp32 on CPU in one process: no gathered copies
    assert memory_terms(TINY, Layout(1, 1, 1, 1), Workload(10, device="cpu"), False)["gathered"] == 0


def test_candidate_layouts_divide_the_gpus_the_heads_and_the_node():
    shape = KNOWN_MODELS["Llama-3-70B"]
    layouts = candidate_layouts(shape, 128)
    assert layouts and len(set(layouts)) == len(layouts)
    for layout in layouts:
        assert layout.gpus == 128 and layout.tp * layout.cp <= 8
        assert shape.num_key_value_heads % layout.tp == 0 and (shape.num_attention_heads // layout.tp) % layout.cp == 0
        assert layout.dp_replicate == 1 or (layout.shard_group % 8 == 0)  # HSDP copies are whole nodes
    assert Layout(16, 8, 1, 1) in layouts and Layout(1, 16, 8, 1) in layouts
    # Qwen2.5-1.5B: 12 heads, 2 key/value heads: tp 1 or 2; cp divides 12 / tp
    small = candidate_layouts(KNOWN_MODELS["Qwen2.5-1.5B"], 8)
    assert {layout.tp for layout in small} == {1, 2}
    assert {(layout.tp, layout.cp) for layout in small} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)}


def test_the_named_examples_pick_a_layout_that_fits_for_the_right_reason():
    # Qwen2.5-1.5B on 1 x 80 GB at 4K: the only layout, without activation checkpointing
    chosen, reason = choose(KNOWN_MODELS["Qwen2.5-1.5B"], 1, 80, Workload(4096))
    assert chosen.layout == Layout(1, 1, 1, 1) and not chosen.activation_checkpointing
    assert chosen.total <= 80 * GIB and "fastest layout" in reason
    # Qwen2.5-32B on 8 x 80 GB at 16K: 16 B/param of state over 8 GPUs is 61 GiB, so activations must be
    # checkpointed, and plain FSDP (tp = cp = 1) still does not fit: tp or cp must split them further
    result = plan(KNOWN_MODELS["Qwen2.5-32B"], 8, 80, Workload(16384))
    assert result.choice and result.choice.total <= 80 * GIB and result.choice.activation_checkpointing
    assert result.choice.layout.tp * result.choice.layout.cp >= 2
    assert not any(e.fits(80 * GIB) for e in result.estimates if e.layout.tp == e.layout.cp == 1)
    # Llama-3-70B on 128 x 80 GB at 16K: no layout fits without checkpointing (a 16K micro-batch's activations are
    # 80 layers x 16384 x 442 KB = 540 GiB before tp x cp <= 8 divides them); with it, it fits
    result = plan(KNOWN_MODELS["Llama-3-70B"], 128, 80, Workload(16384))
    assert result.choice and result.choice.activation_checkpointing and result.choice.total <= 80 * GIB
    assert not any(e.fits(80 * GIB) for e in result.estimates if not e.activation_checkpointing)


def test_the_prediction_is_within_15_percent_of_the_measured_h200_peaks():
    """docs/benchmarks.md: the 1.5B on one H200 (FSDP2 world 1, bf16, no KL, micro-batches of 16,384 tokens,
    head chunks of 2048; sequences of 384-1408 tokens) peaked at 77.1 GiB eager and 31.3 GiB with activation
    checkpointing, as torch.cuda.max_memory_allocated (no CUDA context nor allocator cache: runtime 0)."""
    workload = Workload(1408, micro_batch_tokens=16384, generation="none", runtime_gib=0.0)
    for checkpointing, measured in ((False, 77.1), (True, 31.3)):
        predicted = estimate(KNOWN_MODELS["Qwen2.5-1.5B"], Layout(1, 1, 1, 1), workload, checkpointing, 1e15).total
        assert abs(predicted / GIB / measured - 1) <= 0.15, (checkpointing, predicted / GIB)


def test_nothing_fits_is_a_one_line_error_naming_what_to_change():
    with pytest.raises(ConfigError) as error:
        choose(KNOWN_MODELS["Llama-3-70B"], 8, 80, Workload(16384))
    message = str(error.value)
    assert "\n" not in message and "no layout fits in 80 GiB" in message and "more GPUs" in message


def test_auto_layout_gives_training_parallel_fields_and_reads_the_lora_settings():
    fields = auto_layout(ModelConfig(name_or_path="Qwen/Qwen2.5-32B"), 8, 80, 16384)
    assert set(fields) == {"dp_replicate", "dp_shard", "tp", "cp"}
    assert fields["dp_replicate"] * fields["dp_shard"] * fields["tp"] * fields["cp"] == 8
    assert fields["tp"] * fields["cp"] >= 2
    # LoRA: no gradients or AdamW state for the frozen base (4 B/param / 8 GPUs) leaves room for plain FSDP
    lora = ModelConfig(name_or_path="Qwen/Qwen2.5-32B", lora=LoraConfig(rank=16))
    assert auto_layout(lora, 8, 80, 16384, activation_checkpointing=True) == dict(
        dp_replicate=1, dp_shard=8, tp=1, cp=1
    )
    with pytest.raises(ConfigError, match="no layout fits"):
        auto_layout(ModelConfig(name_or_path="Qwen/Qwen2.5-32B"), 8, 80, 16384, activation_checkpointing=False)


def test_unknown_model_is_a_one_line_error():
    with pytest.raises(ConfigError, match="no model config for 'nowhere/none'"):
        model_shape("nowhere/none")


def test_the_cli_prints_every_layout_and_the_choice(capsys):
    argv = ["plan", "--model", "Qwen2.5-1.5B", "--gpus", "1", "--gpu-memory", "80", "--seq-len", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "choice: dp_replicate=1 dp_shard=1 tp=1 cp=1, activation checkpointing off" in out
    assert "params      = 4 B x 1,543,714,304 / 1 = 5.75 GiB" in out
    assert main(["plan", "--model", "Llama-3-70B", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "16384"]) == 0
    assert "nothing fits: no layout fits in 80 GiB" in capsys.readouterr().out


def test_the_cpu_prediction_is_within_15_percent_of_a_measured_one_process_step(tmp_path):
    """bench/plan_memory.py on the demo model in one process (LocalStrategy): the measured peak resident memory of
    a logprob pass and a training step against the planner's CPU terms plus the process baseline measured in it."""
    out = tmp_path / "plan_memory.json"
    command = [sys.executable, str(PROJECT_ROOT / "bench" / "plan_memory.py"), "--layouts", "demo:local"]
    subprocess.run([*command, "--steps", "1", "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())["layouts"]["demo:local"]
    assert result["within_tolerance"], result
    assert result["predicted_terms_gib"]["activations"] > 0.05  # the step is more than the process baseline


TINY_MOE = ModelShape(8, 2, 2, 1, 16, 32, True, False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)


def test_qwen3_30b_a3b_has_30_5b_parameters_of_which_3_3b_are_active(capsys):
    """48 layers, H 2048, 32 heads of 128 (Q 4096), 4 kv heads (512), 128 experts of width 768, top-8, V 151936,
    untied. A layer: attention 2048 x 4096 + 2 x 2048 x 512 + 4096 x 2048 = 18,874,368; router 128 x 2048 = 262,144;
    experts 128 x 3 x 2048 x 768 = 603,979,776; norms 2 x 2048 + q/k norms 2 x 128 = 4,352: 623,120,640. Root
    2 x 151,936 x 2048 + 2048 = 622,331,904. Total 48 x 623,120,640 + 622,331,904 = 30,532,122,624 (the public 30.5B).
    Active: all but the 48 x 603,979,776 = 28,991,029,248 expert parameters, plus 8/128 of them (1,811,939,328):
    3,353,032,704 (the public 3.3B)."""
    shape = model_shape("Qwen/Qwen3-30B-A3B-Instruct-2507")
    assert shape == KNOWN_MODELS["Qwen3-30B-A3B"]
    assert shape.parameters() == 30_532_122_624 and shape.active_parameters() == 3_353_032_704
    argv = ["plan", "--model", "Qwen3-30B-A3B", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Qwen3-30B-A3B: 30,532,122,624 parameters (3,353,032,704 active: top-8 of 128 experts)" in out
    assert "params      = 4 B x (1,541,093,376 + experts 28,991,029,248) / 8" in out and " ep=8" in out


def test_moe_parameter_counts_are_those_of_the_transformers_model(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, moe_intermediate_size=4, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    model = Qwen3MoeForCausalLM(config)
    shape = model_shape(str(tmp_path))
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert shape.active_parameters() == shape.parameters() - experts + experts * 2 // 4


def test_moe_memory_terms_with_expert_parallelism_by_hand():
    """TINY_MOE: H 8, 2 layers, 2 heads of 4, 1 kv head, 4 experts of width 4, top-2, V 32, tied, no biases.
    A layer: attention 64 + 32 + 32 + 64 = 192, router 4 x 8 = 32, experts 4 x 3 x 8 x 4 = 384, norms 16: 624; root
    264; P = 1512, of which P_e = 768 experts and 744 the rest. On GPU (b = 2), 10 tokens:
    dp_shard 4, ep 4: params 4 x (744 / 4 + 768 / 4) = 1512; a gathered layer 240 + 384 / ep 4 = 336, gathered
    2 x (2 x 336 + 264 + 336 + 264) = 3072 (ep 1: 2 x (2 x 624 + 264 + 624 + 264) = 4800);
    dp_shard 2, tp 2, ep 2: the experts split over ep 2 by expert and over tp 2 by their width, so every part shards
    over the 4 ranks: params 4 x (744 + 768) / 4 = 1512, a gathered layer 240 / 2 + 384 / (2 x 2) = 216.
    Activations per token and layer: norms 2 x 8 x (4 + 4) = 128, attention 5 x 8 x 2 + 4 x 2 = 88 (/ tp); experts
    2 routed x (4 x 4 x 2 + 2 x 8 x 2) + 4 x 4 router logits = 144 (not / tp), the mask 10 x 10 x 2 = 200 per
    layer: 2 x (10 x (216 + 144) + 200) = 7600 at tp 1."""
    workload = Workload(seq_len=10, runtime_gib=0.0)
    assert TINY_MOE.parameters() == 1512 and TINY_MOE.active_parameters() == 1512 - 768 + 384
    # ep: the largest that divides dp_shard x cp and the experts
    assert candidate_layouts(TINY_MOE, 4) == [Layout(1, 4, 1, 1, 4), Layout(1, 2, 1, 2, 4)]
    terms = memory_terms(TINY_MOE, Layout(1, 4, 1, 1, 4), workload, activation_checkpointing=False)
    assert (terms["params"], terms["grads"], terms["optimizer"]) == (1512, 1512, 3024)
    assert terms["gathered"] == 3072 and terms["activations"] == 7600
    assert memory_terms(TINY_MOE, Layout(1, 4, 1, 1, 1), workload, False)["gathered"] == 4800
    tp_ep = memory_terms(TINY_MOE, Layout(1, 2, 2, 1, 2), workload, False)
    assert tp_ep["params"] == 1512 and tp_ep["gathered"] == 2 * (2 * 216 + 264 / 2 + 216 + 264 / 2)
    assert auto_layout("Qwen3-30B-A3B", 8, 80, 4096)["ep"] == 8


REFERENCE_CASES = [  # (the model as a run names it, GPUs, tokens): the three
    ("Qwen/Qwen2.5-1.5B", 1, 4096),
    ("Qwen/Qwen2.5-32B", 8, 16384),
    ("meta-llama/Llama-3.3-70B-Instruct", 128, 16384),
]


@pytest.mark.parametrize("model, gpus, seq_len", REFERENCE_CASES)
def test_the_reference_cases_keep_the_margin_and_their_printed_keys_pass_the_dry_run(capfd, model, gpus, seq_len):
    """Each reference case's choice leaves 10% of every GPU free, and the config keys `reinforge plan` prints for
    it are accepted by `reinforge grpo --validate` (the run's own layout checks, no weights, no Ray)."""
    result = plan(model_shape(model), gpus, 80, Workload(seq_len))
    assert result.margin == 0.10 and result.choice is not None
    assert max(result.choice.total, result.choice.engine_total) <= 0.9 * 80 * GIB
    argv = ["plan", "--model", model, "--gpus", str(gpus), "--gpu-memory", "80", "--seq-len", str(seq_len)]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "margin: 10% of each GPU kept free, so a layout fits in 72.0 of 80 GiB" in out
    keys = next(line for line in out.splitlines() if line.startswith("config keys: ")).split()[2:]
    assert f"training.num_workers={gpus}" in keys and "generation.backend=vllm" in keys
    demo = str(PROJECT_ROOT / "configs" / "grpo_demo.yaml")
    assert main(["grpo", "--config", demo, "--validate", f"model.name_or_path={model}", *keys]) == 0
    out = capfd.readouterr().out
    assert out.splitlines()[-1] == "valid: no weights loaded, Ray not started", out


def test_the_dry_run_refuses_engines_the_run_would_refuse(capfd):
    """An engine whose tensor-parallel size does not divide the demo model's 2 heads, and colocated engines with
    more workers than training ranks: each a one-line error of `--validate`, as of the run."""
    demo = str(PROJECT_ROOT / "configs" / "grpo_demo.yaml")
    base = ["grpo", "--config", demo, "--validate", "training.backend=fsdp2", "training.num_workers=2"]
    assert main([*base, "generation.backend=vllm", "generation.vllm.tensor_parallel_size=2"]) == 0
    assert (
        main([*base, "generation.backend=vllm", "generation.vllm.tensor_parallel_size=4", "cluster.colocate=false"])
        == 2
    )
    assert "must divide the model's 2 attention heads" in capfd.readouterr().err
    two = ["generation.num_workers=2", "generation.backend=vllm", "generation.vllm.tensor_parallel_size=2"]
    assert main([*base, *two]) == 2
    assert "= 4 engine workers > training.num_workers=2 with cluster.colocate=true" in capfd.readouterr().err
