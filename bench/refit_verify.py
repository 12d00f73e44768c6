"""What refit verification (`generation.verify_refit_every`, generation/weight_digest.py) costs.

    python bench/refit_verify.py --json bench/results/refit_verify.json

1. The demo: `reinforge grpo --config configs/grpo_demo.yaml` for `--steps` steps with each engine (hf,
   vllm); per step, timing/refit_verify_s (both sides' digests and the comparison) against timing/step_s;
   medians over steps 2..N (step 1 also runs the consistency probe).
2. Scaling: for three model sizes (the demo model, ~30M and ~155M parameters, random weights, fp32), each
   in its own process because a process holds one vLLM engine: the trainer side's digests of the state
   dict (sha256 of every tensor, on all cores), the HF engine's, and the vLLM engine's (on CPU its linear
   weights are read back through vLLM's own GEMM kernel first); seconds and GB/s of parameter bytes. These are
   the whole-weight digests (`generation.verify_refit_columns=0`, the check before it sampled columns). Then the
   check as a refit runs it now (`*_stream_*`): the expected digests built decoder layer by decoder layer
   (`Expectation.add`) and each engine's digests, of `--columns` sampled columns per weight, and the comparison.
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

from bench._common import MODEL_30M, write_result  # noqa: E402

SIZES = {  # name: Qwen2 shape overrides on top of the demo model's config (None: the demo model itself)
    "demo": None,
    "30M": MODEL_30M,
    "155M": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16
    ),
}


def demo_run(backend: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "reinforge.cli", "grpo", "--config", str(ROOT / "configs" / "grpo_demo.yaml"),
            f"generation.backend={backend}", f"loop.max_steps={steps}", "loop.val_every=0",
            "checkpoint.save_final=false", f"logging.run_dir={tmp}/run",
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()][2:]
    verify = statistics.median(row["timing/refit_verify_s"] for row in rows)
    step = statistics.median(row["timing/step_s"] for row in rows)
    return {
        "backend": backend,
        "steps_measured": len(rows),
        "step_s_median": step,
        "refit_s_median": statistics.median(row["timing/refit_s"] for row in rows),
        "refit_verify_s_median": verify,
        "verify_fraction_of_step": verify / step,
    }


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def by_layer(weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The weights in the groups a refit sends: one decoder layer each, what lies outside the layers first."""
    import re

    groups: dict[int, dict] = {}
    for name, tensor in weights.items():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        groups.setdefault(-1 if layer is None else int(layer[1]), {})[name] = tensor
    return [groups[key] for key in sorted(groups)]


def streamed_expectation(layouts, groups, columns: int, step: int):
    """The expected digests as a refit builds them while it sends: group by group."""
    from reinforge.generation.weight_digest import Expectation

    expectation = Expectation(layouts, columns, step)
    for group in groups:
        expectation.add(group)
    return expectation


def streamed_check(engine, layouts, groups, columns: int, step: int) -> None:
    from reinforge.generation.weight_digest import check

    check(engine.weight_digests(columns, step), streamed_expectation(layouts, groups, columns, step))


def scaling_one(size: str, repeats: int, columns: int = 32) -> dict:
    """Runs in a child process: build the model, start a vLLM engine, time each side's digests."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from reinforge.generation.checkpoint_layout import checkpoint_layout
    from reinforge.generation.hf import HFGenerationBackend
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.generation.weight_digest import digest_all, verify

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
        weights = dict(model.state_dict())
        num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        hf = HFGenerationBackend(AutoModelForCausalLM.from_pretrained(path), None, 1)
        vllm = VLLMGenerationBackend(str(path), dtype="float32", seed=0, max_model_len=256)
        vllm.update_weights(weights.items())
        verify(vllm.weight_digests(), weights)  # the engine serves exactly these weights
        seconds = {
            "trainer_digests_s": timed(lambda: digest_all(weights.items()), repeats),
            "hf_engine_digests_s": timed(hf.weight_digests, repeats),
            "vllm_engine_digests_s": timed(vllm.weight_digests, repeats),
            "vllm_verify_s": timed(lambda: verify(vllm.weight_digests(), weights), repeats),
            "hf_verify_s": timed(lambda: verify(hf.weight_digests(), weights), repeats),
        }
        hf.update_weights(weights.items())
        hf_layouts, vllm_layouts = hf.weight_layout(), vllm.weight_layout()
        sent = by_layer(checkpoint_layout(str(path), weights.items(), drop=vllm.untied_names))
        seconds |= {
            "trainer_stream_expected_s": timed(lambda: streamed_expectation(vllm_layouts, sent, columns, 1), repeats),
            "hf_engine_stream_digests_s": timed(lambda: hf.weight_digests(columns, 1), repeats),
            "vllm_engine_stream_digests_s": timed(lambda: vllm.weight_digests(columns, 1), repeats),
            "hf_stream_verify_s": timed(lambda: streamed_check(hf, hf_layouts, by_layer(weights), columns, 1), repeats),
            "vllm_stream_verify_s": timed(lambda: streamed_check(vllm, vllm_layouts, sent, columns, 1), repeats),
        }
    return {
        "size": size,
        "num_params": sum(p.numel() for p in model.parameters()),
        "param_bytes": num_bytes,
        **seconds,
        "trainer_digest_gb_per_s": num_bytes / seconds["trainer_digests_s"] / 1e9,
        "vllm_engine_digest_gb_per_s": num_bytes / seconds["vllm_engine_digests_s"] / 1e9,
        "repeats": repeats,
        "columns": columns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "refit_verify.json")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--columns", type=int, default=32, help="generation.verify_refit_columns of the new check")
    parser.add_argument("--sizes", default=",".join(SIZES), help="the scaling part's model sizes, comma-separated")
    parser.add_argument("--no-runs", action="store_true", help="the scaling part only (no demo GRPO runs)")
    parser.add_argument("--scaling-only", metavar="SIZE", help=argparse.SUPPRESS)  # the child process mode
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.scaling_only:
        print(json.dumps(scaling_one(args.scaling_only, args.repeats, args.columns)))
        return
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "demo": [],
        "scaling": [],
    }
    for backend in () if args.no_runs else ("hf", "vllm"):
        results["demo"].append(demo_run(backend, args.steps))
        print(json.dumps(results["demo"][-1]))
    for size in args.sizes.split(","):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--scaling-only",
                size,
                "--repeats",
                str(args.repeats),
                "--columns",
                str(args.columns),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results["scaling"].append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(json.dumps(results["scaling"][-1]))
    write_result(args.json, results)


if __name__ == "__main__":
    main()
