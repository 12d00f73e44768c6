"""Which model families vLLM serves here, and whether their refit holds: for each family of tests/model_families.py
(or those named), in a fresh process: start the engine as reinforge does, sample, compare vLLM's logprobs of the
sampled tokens with a plain transformers forward of the same model (mismatch: mean exp|diff|), then refit every
weight perturbed, verify the refit (weight_digest.py) and compare again. One JSON object per family on stdout,
and all of them in --out.

    python scripts/vllm_families.py [--out FILE] [family ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(14)] for i in range(4)]  # longer than the windows of 8


def mismatch(model, result) -> float:
    """Mean exp|vLLM logprob - transformers logprob| over every sampled token (temperature 1: the plain softmax)."""
    import torch

    diffs = []
    for prompt, completions in zip(PROMPTS, result.completions):
        for completion in completions:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            reference = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            diffs.append((reference - torch.tensor(completion.logprobs)).abs())
    return torch.cat(diffs).exp().mean().item()


def one_family(name: str) -> dict:
    """In this process: the engine's load, mismatch at start, refit check and mismatch after the refit."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from model_families import build

    from reinforge.generation.base import SamplingParams
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.generation.weight_digest import verify

    out: dict = {"family": name}
    settings = json.loads(os.environ.get("FAMILY_SETTINGS", "{}"))  # config values to try instead of the family's
    path = build(
        name, Path(tempfile.mkdtemp()) / name, edit=lambda config: [setattr(config, k, v) for k, v in settings.items()]
    )
    if settings:
        out["settings"] = settings
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    params = SamplingParams(max_new_tokens=24, temperature=1.0, num_samples=2, seed=1)
    try:
        engine = VLLMGenerationBackend(str(path), "float32", seed=0, max_model_len=128, block_size=32)
    except Exception as error:  # the survey records what the engine says
        out.update(loads=False, error=f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}")
        return out
    out["loads"] = True
    # vLLM's Transformers backend (OLMo 2) patches transformers' model class in this process: calling an instance
    # made before it fails on `do_not_compile`, which the reference here (eager, hook-free) may simply set
    for module in model.modules():
        if not hasattr(module, "do_not_compile"):
            module.do_not_compile = True
    try:
        out["mismatch_start"] = round(mismatch(model, engine.generate(PROMPTS, params)), 5)
        torch.manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
        sent = dict(model.state_dict())
        engine.update_weights(sent.items())
        verify(engine.weight_digests(), sent)
        out["refit_verified"] = True
        out["mismatch_after_refit"] = round(mismatch(model, engine.generate(PROMPTS, params)), 5)
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_family(args.one)), flush=True)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from model_families import FAMILIES

    results = []
    for name in args.families or list(FAMILIES):
        run = subprocess.run(
            [sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=900, cwd=ROOT
        )
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1].removeprefix("RESULT "))
        else:  # the process died: its last words
            tail = [line for line in run.stderr.splitlines() if line.strip()][-1:]
            result = {"family": name, "loads": False, "error": f"process died (rc {run.returncode}): {tail}"}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
