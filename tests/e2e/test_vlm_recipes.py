"""The vision-language demo (models/vlm_demo, data/vlm_demo) through the recipes: GRPO raises validation accuracy
on the HF engine and, on vLLM, with every token's engine probability equal to the trainer's; LoRA on the language
model only learns and saves an adapter without vision weights; SFT on image chats lowers the validation loss;
final/ holds the processor beside the weights."""

import json

import pytest
from safetensors import safe_open
from transformers import AutoProcessor

from reinforge import loops
from reinforge.algorithms import sft
from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.config.loader import load_recipe_config
from reinforge.loops.supervised import train
from reinforge.paths import PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"
SHORT = [  # the demo's 40 steps cut to 12: accuracy 0.645 -> ~0.9 by step 10 in the full run (docs/vlm.md)
    "loop.max_steps=12",
    "loop.val_every=12",
    "data.max_val_prompts=100",
]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def grpo_run(config_name, tmp_path, *overrides):
    config = load_recipe_config(
        GRPORunConfig, CONFIGS / config_name, [*SHORT, f"logging.run_dir={tmp_path / 'run'}", *overrides]
    )
    return loops.train(config)


def test_grpo_on_the_vlm_demo_learns_and_exports_the_processor(tmp_path):
    result = grpo_run("grpo_vlm_demo.yaml", tmp_path)
    assert result.last_val_accuracy - result.first_val_accuracy >= 0.1, result
    assert all(r["train/token_mult_prob_error"] <= 1.05 for r in rows(result.run_dir) if "train/loss" in r)
    processor = AutoProcessor.from_pretrained(result.run_dir / "final")  # loads as it was given
    assert processor.image_seq_len == 4


@pytest.mark.xdist_group("ray")  # vLLM takes the machine's cores (tests/conftest.py)
def test_grpo_on_the_vlm_demo_with_vllm_matches_the_trainer_on_every_step(tmp_path):
    result = grpo_run("grpo_vlm_demo.yaml", tmp_path, "generation.backend=vllm")
    steps = [r for r in rows(result.run_dir) if "train/loss" in r]
    assert len(steps) == 12
    assert all(r["train/token_mult_prob_error"] <= 1.05 for r in steps), [
        r["train/token_mult_prob_error"] for r in steps
    ]
    assert result.last_val_accuracy - result.first_val_accuracy >= 0.1, result


def test_lora_grpo_on_the_vlm_demo_learns_with_the_vision_side_untouched(tmp_path):
    result = grpo_run("grpo_vlm_lora_demo.yaml", tmp_path)
    assert result.last_val_accuracy - result.first_val_accuracy >= 0.1, result
    with safe_open(result.run_dir / "final" / "adapter_model.safetensors", "pt") as adapter:
        names = list(adapter.keys())
    assert names and all("text_model" in name for name in names), [n for n in names if "text_model" not in n][:3]


def test_sft_on_image_chats_lowers_the_validation_loss(tmp_path):
    config = load_recipe_config(
        sft.SFTRunConfig,
        CONFIGS / "sft_vlm_demo.yaml",
        ["sft.max_steps=40", "sft.val_every=40", f"logging.run_dir={tmp_path / 'run'}"],
    )
    result = train(config, sft.SFT)
    assert result.last_val["val/loss"] < 0.5 * result.first_val["val/loss"], result


def test_eval_on_an_image_benchmark_answers_as_a_plain_generate(tmp_path):
    """`reinforge eval --benchmark vlm_sums` (and the same file given as a path): each greedy answer is the one
    transformers' own generate gives the picture and question, scored against the file's answer."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from reinforge.evaluation.evaluate import evaluate
    from reinforge.model_config import ModelConfig

    model_dir = PROJECT_ROOT / "models" / "vlm_demo"
    result = evaluate(
        ModelConfig(name_or_path=str(model_dir)), "vlm_sums", k=1, limit=6, backend="hf", max_new_tokens=32
    )
    by_path = evaluate(
        ModelConfig(name_or_path=str(model_dir)),
        str(PROJECT_ROOT / "data" / "benchmarks" / "vlm_sums" / "test.jsonl"),
        k=1,
        limit=6,
        backend="hf",
        max_new_tokens=32,
    )
    assert [s.response for s in by_path.samples] == [s.response for s in result.samples]
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in (PROJECT_ROOT / "data/benchmarks/vlm_sums/test.jsonl").open()][:6]
    for row, sample in zip(rows, result.samples):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"]}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        image = Image.open(PROJECT_ROOT / "data/benchmarks/vlm_sums" / row["images"][0]).convert("RGB")
        inputs = processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert sample.response == expected
        assert sample.correct == (sample.extracted == row["answer"])
    assert result.summary["pass@1"] == sum(s.correct for s in result.samples) / len(result.samples)


def test_a_benchmark_file_with_a_missing_image_is_one_line(tmp_path, capsys):
    from reinforge.cli import main

    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"question": "add", "images": ["nowhere.png"], "answer": "3"}) + "\n")
    args = ["eval", "--model", "models/vlm_demo", "--benchmark", str(path), "--k", "1", "--backend", "hf"]
    status = main([*args, "--output", str(tmp_path / "out")])
    stderr = capsys.readouterr().err.strip()
    assert status == 2 and not (tmp_path / "out").exists()
    assert len(stderr.splitlines()) == 1 and "/0: image 'nowhere.png': no such file" in stderr, stderr


def test_dpo_on_image_pairs_prefers_the_right_sums(tmp_path):
    from reinforge.algorithms import dpo

    config = load_recipe_config(
        dpo.DPORunConfig,
        CONFIGS / "dpo_vlm_demo.yaml",
        ["dpo.max_steps=10", "dpo.val_every=10", f"logging.run_dir={tmp_path / 'run'}"],
    )
    result = train(config, dpo.DPO)
    assert result.first_val["val/loss"] > 0.69 and result.last_val["val/loss"] < 0.5, result
    assert result.last_val["val/logp_accuracy"] > 0.9 > result.first_val["val/logp_accuracy"], result


@pytest.mark.xdist_group("ray")  # two FSDP2 ranks on Ray
def test_two_fsdp2_ranks_train_the_vlm_as_one_process_does(tmp_path):
    """FSDP2 shards the decoder's and the vision encoder's layers; two ranks give the one process's losses and
    gradient norms step for step."""
    short = ["loop.max_steps=2", "data.val_path=null", "checkpoint.save_final=false"]
    one = grpo_run("grpo_vlm_demo.yaml", tmp_path / "one", *short)
    two = grpo_run("grpo_vlm_demo.yaml", tmp_path / "two", *short, "training.backend=fsdp2", "training.num_workers=2")
    steps_one, steps_two = ([r for r in rows(run.run_dir) if "train/loss" in r] for run in (one, two))
    assert len(steps_one) == 2
    for a, b in zip(steps_one, steps_two, strict=True):
        for name in ("train/loss", "train/grad_norm", "train/reward_mean"):
            assert abs(a[name] - b[name]) <= 1e-4 * max(1.0, abs(a[name])), (name, a[name], b[name])


@pytest.mark.xdist_group("ray")  # vLLM takes the machine's cores (tests/conftest.py)
def test_in_flight_image_prompts_on_vllm_match_the_version_that_sampled_each_token(tmp_path):
    """In flight, image requests join vLLM's running batch and weights land between its steps; every token's engine
    logprob equals the trainer's under the version that sampled it. (How many sequences span an update depends on
    timing; the forced mid-generation update is tests/unit/test_in_flight.py's.)"""
    config = load_recipe_config(
        GRPORunConfig,
        CONFIGS / "grpo_vlm_demo.yaml",
        [
            "loop.max_steps=4",  # three refits, tokens of four versions checked
            "data.val_path=null",
            "checkpoint.save_final=false",
            "rollout.mode=in_flight",
            "rollout.version_check=true",
            "generation.backend=vllm",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    steps = [r for r in rows(loops.train(config).run_dir) if "train/loss" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["train/version_matched/token_share"] == 1.0
        assert r["train/version_matched/token_mult_prob_error"] <= 1.05, r[
            "train/version_matched/token_mult_prob_error"
        ]
