"""reinforge convert: a GRPO checkpoint becomes a Hugging Face directory equal to the trained policy."""

import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

from reinforge.paths import PROJECT_ROOT


def test_a_checkpoint_converts_to_the_same_weights_as_the_final_export(tmp_path):
    run = tmp_path / "run"
    grpo = [sys.executable, "-m", "reinforge.cli", "grpo", "--config", str(PROJECT_ROOT / "configs" / "grpo_demo.yaml"),
            "grpo.max_steps=1", "checkpoint.save_every=1", "grpo.num_prompts_per_step=4", "training.global_batch_size=32",
            "training.micro_batch_size=32", "data.max_val_prompts=4", f"logging.run_dir={run}"]
    assert subprocess.run(grpo, capture_output=True, timeout=600).returncode == 0
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "reinforge.cli", "convert", str(run / "checkpoints" / "step_00000001"),
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    converted = AutoModelForCausalLM.from_pretrained(out).state_dict()
    final = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    assert converted.keys() == final.keys() and all(torch.equal(converted[k], final[k]) for k in final)
    assert (out / "tokenizer_config.json").is_file()
    again = subprocess.run([sys.executable, "-m", "reinforge.cli", "convert", str(run), "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr
