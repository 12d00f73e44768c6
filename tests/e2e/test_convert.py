"""reinforge convert: a GRPO checkpoint becomes a Hugging Face directory equal to the trained policy; a LoRA run's
checkpoint and final/ become its PEFT adapter or (--merge) the merged model."""

import json
import subprocess
import sys

import peft
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.cli import main
from reinforge.paths import PROJECT_ROOT
from reinforge.training.convert import convert


def test_a_checkpoint_converts_to_the_same_weights_as_the_final_export(tmp_path, capsys):
    """The run and the refusals through cli.main in this process (no interpreter start-up each); the conversion
    through the real command line."""
    run = tmp_path / "run"
    grpo = [
        "grpo",
        "--config",
        str(PROJECT_ROOT / "configs" / "grpo_demo.yaml"),
        "loop.max_steps=1",
        "checkpoint.save_every=1",
        "rollout.num_prompts_per_step=4",
        "training.global_batch_size=32",
        "training.micro_batch_size=32",
        "data.max_val_prompts=4",
        f"logging.run_dir={run}",
        "cluster.max_restarts=0",
    ]
    assert main(grpo) == 0, capsys.readouterr().err[-3000:]
    out = tmp_path / "hf"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "reinforge.cli",
            "convert",
            str(run / "checkpoints" / "step_00000001"),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    converted = AutoModelForCausalLM.from_pretrained(out).state_dict()
    final = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    assert converted.keys() == final.keys() and all(torch.equal(converted[k], final[k]) for k in final)
    assert (out / "tokenizer_config.json").is_file()
    capsys.readouterr()
    assert main(["convert", str(run), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(run), "--output", str(tmp_path / "merged"), "--merge"]) == 2
    assert "holds a whole model, not a LoRA adapter" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_a_lora_run_exports_merged_models_whose_logprobs_are_the_adapter_models(tmp_path, capsys):
    """A LoRA GRPO checkpoint converts to the PEFT adapter of final/ (--merge: the merged model), and final/ merges
    too; on the trained policy's greedy answers to validation prompts the merged models' logprobs equal the adapter
    model's (PEFT's, on the base) to fp32's rounding: 8 units in the last place of the largest logit (~20 here: 1.9e-5;
    measured up to 1.0e-5), against > 1e-3 between the adapter model and its base."""
    overrides = [
        "loop.max_steps=2",
        "checkpoint.save_every=2",
        "rollout.num_prompts_per_step=4",
        "training.global_batch_size=32",
        "training.micro_batch_size=32",
        "data.max_val_prompts=4",
        f"logging.run_dir={tmp_path / 'run'}",
    ]
    run = loops.train(load_config(PROJECT_ROOT / "configs" / "grpo_lora_demo.yaml", overrides)).run_dir
    checkpoint = run / "checkpoints" / "step_00000002"
    assert main(["convert", str(checkpoint), "--output", str(tmp_path / "merged_checkpoint"), "--merge"]) == 0
    convert(checkpoint, tmp_path / "adapter")
    convert(run / "final", tmp_path / "merged_final", merge=True)
    converted, final = (
        load_file(directory / "adapter_model.safetensors") for directory in (tmp_path / "adapter", run / "final")
    )
    assert converted.keys() == final.keys() and all(torch.equal(converted[k], final[k]) for k in final)

    demo = PROJECT_ROOT / "models" / "demo"
    adapter_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo), run / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(demo)
    prompts = [
        json.loads(line)["prompt"]
        for line in (PROJECT_ROOT / "data" / "demo" / "val.jsonl").read_text().splitlines()[:8]
    ]
    sequences = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            sequences.append((ids.shape[1], adapter_model.generate(input_ids=ids, max_new_tokens=32, do_sample=False)))

    def answer_logprobs(model):
        with torch.no_grad():
            return torch.cat(
                [
                    torch.log_softmax(model(input_ids=ids).logits[0, n - 1 : -1], -1).gather(-1, ids[0, n:, None])[:, 0]
                    for n, ids in sequences
                ]
            )

    expected = answer_logprobs(adapter_model)
    with torch.no_grad():
        largest_logit = max(float(adapter_model(input_ids=ids).logits.abs().max()) for _, ids in sequences)
    tolerance = 8 * torch.finfo(torch.float32).eps * largest_logit
    assert tolerance < 1e-4
    for merged in ("merged_checkpoint", "merged_final"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / merged).eval()
        assert not any(".lora_" in name for name in model.state_dict())
        assert (answer_logprobs(model) - expected).abs().max() <= tolerance, merged
    assert (
        answer_logprobs(AutoModelForCausalLM.from_pretrained(demo)) - expected
    ).abs().max() > 1e-3  # the adapter moved the policy

    capsys.readouterr()
    for source, out, message in [
        (run / "final", tmp_path / "new", "already a PEFT adapter directory; add --merge"),
        (checkpoint, tmp_path / "adapter", "already exists"),
    ]:
        assert main(["convert", str(source), "--output", str(out)]) == 2
        stderr = capsys.readouterr().err
        assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
