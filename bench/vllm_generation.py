"""Generation throughput through reinforge's vLLM backend vs calling vLLM directly, and refit time.

    python bench/vllm_generation.py --json OUT.json

1. Overhead: the same engine, prompts and sampling parameters, alternately through
   `VLLMGenerationBackend.generate` (token ids in, `GenerationResult` out) and through `LLM.generate`
   directly, alternating which goes first; median of the repeats;
   overhead = 1 - reinforge_tokens_per_s / direct_tokens_per_s.
2. Refit: `update_weights` with a full state dict for three model sizes (the demo model, ~30M and
   ~150M parameters with random weights and the demo tokenizer), each in its own process because a
   process holds one vLLM engine. Median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {  # name: Qwen2 shape overrides on top of the demo model's config (None: the demo model itself)
    "demo": None,
    "30M": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8
    ),
    "150M": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16
    ),
}


def overhead(num_prompts: int, num_samples: int, max_new_tokens: int, repeats: int) -> dict:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    from reinforge.data.jsonl import read_jsonl
    from reinforge.data.prompts import render_prompt
    from reinforge.generation.base import SamplingParams
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import load_tokenizer

    model = str(ROOT / "models" / "demo")
    tokenizer = load_tokenizer(ModelConfig(name_or_path=model))
    records = read_jsonl(ROOT / "data" / "demo" / "train.jsonl")[:num_prompts]
    prompt_ids = [render_prompt(r, tokenizer, "prompt", None, True).token_ids for r in records]
    engine = VLLMGenerationBackend(model, dtype="float32", seed=0, max_model_len=512)
    ours = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, num_samples=num_samples, seed=0)
    direct_params = [
        VLLMSamplingParams(
            n=num_samples,
            temperature=1.0,
            max_tokens=max_new_tokens,
            seed=i,
            logprobs=0,
            include_stop_str_in_output=True,
        )
        for i in range(len(prompt_ids))
    ]
    direct_prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]

    def run_ours() -> tuple[float, int]:
        start = time.perf_counter()
        result = engine.generate(prompt_ids, ours)
        return time.perf_counter() - start, sum(len(c.token_ids) for group in result.completions for c in group)

    def run_direct() -> tuple[float, int]:
        start = time.perf_counter()
        outputs = engine.llm.generate(direct_prompts, direct_params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(s.token_ids) for o in outputs for s in o.outputs)

    run_ours(), run_direct()  # warm-up
    ours_tps, direct_tps = [], []
    for repeat in range(repeats):  # alternate which goes first, so neither gains from going second
        for run, record in sorted(
            [(run_ours, ours_tps), (run_direct, direct_tps)],
            key=lambda pair: (pair[0] is run_ours) == (repeat % 2 == 0),
        ):
            seconds, tokens = run()
            record.append(tokens / seconds)
    ours_median, direct_median = statistics.median(ours_tps), statistics.median(direct_tps)
    return {
        "num_prompts": num_prompts,
        "num_samples": num_samples,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "reinforge_tokens_per_s": ours_median,
        "direct_tokens_per_s": direct_median,
        "overhead_fraction": 1 - ours_median / direct_median,
    }


def refit_one(size: str, repeats: int) -> dict:
    """Runs in a child process: build the model, start an engine, time update_weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from reinforge.generation.vllm_backend import VLLMGenerationBackend

    demo = ROOT / "models" / "demo"
    with tempfile.TemporaryDirectory() as tmp:
        path = demo
        if SIZES[size] is not None:
            base = AutoConfig.from_pretrained(demo)
            config = Qwen2Config(
                vocab_size=base.vocab_size,
                eos_token_id=base.eos_token_id,
                pad_token_id=base.pad_token_id,
                tie_word_embeddings=True,
                max_position_embeddings=2048,
                dtype="float32",
                **SIZES[size],
            )
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(demo).save_pretrained(tmp)
            path = Path(tmp)
        model = AutoModelForCausalLM.from_pretrained(path)
        num_params = sum(p.numel() for p in model.parameters())
        engine = VLLMGenerationBackend(str(path), dtype="float32", seed=0, max_model_len=256)
        engine.update_weights(model.state_dict().items())  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.update_weights(model.state_dict().items())
            seconds.append(time.perf_counter() - start)
    return {"size": size, "num_params": num_params, "refit_s_median": statistics.median(seconds), "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--refit-only", metavar="SIZE", help=argparse.SUPPRESS)  # the child process mode
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.refit_only:
        print(json.dumps(refit_one(args.refit_only, args.repeats)))
        return

    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "overhead": overhead(args.num_prompts, args.num_samples, args.max_new_tokens, args.repeats),
        "refit": [],
    }
    print(json.dumps(results["overhead"]))
    for size in SIZES:
        child = subprocess.run(
            [sys.executable, __file__, "--refit-only", size, "--repeats", str(args.repeats)],
            capture_output=True,
            text=True,
            check=True,
        )
        results["refit"].append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(json.dumps(results["refit"][-1]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
