"""GPU: the README's one-GPU recipe, configs/grpo_gsm8k.yaml, run as a user runs it (`reinforge grpo` in a
subprocess) for a few steps: where it computes (the run's `devices:` line), step time, generation and training
time, trained tokens/s and peak GPU memory from its metrics.jsonl.

    python bench/gpu_grpo_recipe.py --json bench/results/gpu_grpo_recipe.json
    python bench/gpu_grpo_recipe.py --model Qwen/Qwen2.5-1.5B-Instruct    # a real checkpoint, where the hub is reached
    python bench/gpu_grpo_recipe.py --tiny    # the demo model on CPU through the same code: checks the script runs

By default the model is Qwen2.5-1.5B's architecture, randomly initialised, with models/demo's tokenizer and its
449-token vocabulary (the GPU machines reach no hub): 1.31B parameters instead of 1.54B (the 151,936-token
embedding is the difference), answers of random tokens that run to `--max-new-tokens` unless the EOS is drawn.
The settings shorten the config's step (fewer prompts, shorter answers, a small validation); the engine, backend,
dtype, compilation and batch shapes per prompt are the config's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import QWEN25_1_5B, write_result  # noqa: E402

METRICS = ("timing/step_s", "timing/generate_s", "timing/train_s", "perf/tokens_per_s", "perf/gpu_peak_memory_gb")


def random_model(out_dir: Path, device: str) -> Path:
    """Qwen2.5-1.5B's architecture on the demo tokenizer's vocabulary, seed 0, saved in bf16 beside its tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "demo")
    architecture = QWEN25_1_5B | {"vocab_size": len(tokenizer)}
    torch.manual_seed(0)
    with torch.device(device):
        config = Qwen2Config(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **architecture
        )
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (path or hub name); default: the random 1.5B architecture")
    parser.add_argument("--tiny", action="store_true", help="models/demo on CPU, tiny settings: the script runs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=16, help="x the config's 8 answers each")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides (key=value)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gpu_grpo_recipe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        print("no CUDA GPU here: nothing measured (--tiny runs the demo model on CPU through the same code)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model, dtype = str(ROOT / "models" / "demo"), ["model.dtype=float32", "training.compile=false"]
        else:
            model, dtype = args.model or str(random_model(Path(tmp) / "model", "cuda")), []
        sequences = args.prompts_per_step * 8
        overrides = [
            f"model.name_or_path={model}",
            f"loop.max_steps={args.steps}",
            f"rollout.num_prompts_per_step={args.prompts_per_step}",
            f"training.global_batch_size={sequences}",
            f"generation.max_new_tokens={args.max_new_tokens}",
            "data.max_val_prompts=16",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp}/run",
            *dtype,
            *args.set,
        ]
        command = [sys.executable, "-m", "reinforge.cli", "grpo", "--config", str(ROOT / "configs/grpo_gsm8k.yaml")]
        start = time.perf_counter()
        done = subprocess.run([*command, *overrides], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"grpo_gsm8k.yaml failed ({done.returncode}):\n{done.stderr[-4000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        shutil.rmtree(Path(tmp) / "run", ignore_errors=True)
    devices = next((line for line in done.stdout.splitlines() if line.startswith("devices:")), None)
    steps = [row for row in rows if "timing/step_s" in row]
    later = steps[1:] or steps  # the first step pays torch.compile's compilation
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (--tiny)",
        "model": args.model or ("models/demo" if args.tiny else "Qwen2.5-1.5B architecture, random, demo vocabulary"),
        "devices_line": devices,
        "sequences_per_step": sequences,
        "max_new_tokens": args.max_new_tokens,
        "wall_s": wall,
        "per_step": [{name: row.get(name) for name in METRICS} for row in steps],
        **{
            f"median_after_first/{name}": statistics.median(r[name] for r in later if name in r) for name in METRICS[:4]
        },
        "peak_gpu_memory_gb": max((r.get("perf/gpu_peak_memory_gb") or 0 for r in steps), default=None),
    }
    print(json.dumps(result, indent=2))
    write_result(args.json, result)


if __name__ == "__main__":
    main()
