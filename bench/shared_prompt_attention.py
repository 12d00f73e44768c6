"""Shared-prompt rows: segment attention against one dense [W, W] mask per row, forward + backward.

    python bench/shared_prompt_attention.py --json bench/results/shared_prompt_attention.json

The batch is one GRPO step of bench/grpo_vs_trl.py's shape: for the demo model 32 prompts x 8 samples
(30-41 prompt tokens, 30-token answers), for the 30M model 8 x 8 with 48-token answers; random tokens.
It is planned and laid out by the training backends' own code (`Prompts`, `plan_micro_batches` with
micro-batches of 4096 tokens, `select_micro_batch`, `row_layout`), then each micro-batch runs forward and backward
(the model's output at
one position per row, summed) two ways on the same weights: through `training/segment_attention.py`
(what the backends do), and with the same attention written as a boolean [R, 1, W, W] mask handed to
the model's sdpa attention (what they did before). One torch thread; the two alternate, the first
round of each is a warm-up; reported: the best and the median of `--rounds`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import build_30m_model, grpo_like_batch, write_result  # noqa: E402

SHAPES = {"demo": (32, 30), "30m": (8, 48)}  # prompts per step, answer tokens
GENERATIONS, MICRO_BATCH_TOKENS = 8, 4096


def layouts(num_prompts: int, answer_tokens: int, vocab_size: int):
    """The step's shared-prompt layouts, planned and selected as the training backends do it."""
    from reinforge.data.packing import row_layout
    from reinforge.training.base import TrainingConfig
    from reinforge.training.micro_batching import Prompts, plan_micro_batches, select_micro_batch

    batch = grpo_like_batch(
        num_prompts * GENERATIONS,
        (30, 41),
        (answer_tokens, answer_tokens),
        vocab_size,
        GENERATIONS,
        shared_prompts=True,
    )
    config = TrainingConfig(
        global_batch_size=len(batch), micro_batch_size=len(batch), micro_batch_tokens=MICRO_BATCH_TOKENS
    )
    result = []
    for rows in plan_micro_batches(batch.attention_mask.sum(dim=1).tolist(), config, Prompts.of(batch, config)):
        micro, local_rows, _ = select_micro_batch(batch, rows)
        result.append(
            row_layout(
                micro.input_ids, micro.attention_mask.sum(dim=1).tolist(), local_rows, 0, micro.prompt_lengths.tolist()
            ).to(torch.device("cpu"))
        )
    return result


def as_dense_mask(layout) -> torch.Tensor:
    """The layout's segments as one [R, 1, W, W] boolean mask; a row's padding attends to itself."""
    from reinforge.data.packing import dense_mask

    rows, width = layout.input_ids.shape
    full = dense_mask(layout)
    mask = torch.stack([full[r * width : (r + 1) * width, r * width : (r + 1) * width] for r in range(rows)])
    mask |= ~mask.any(-1, keepdim=True) & torch.eye(width, dtype=torch.bool)
    return mask.unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,30m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "shared_prompt_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from reinforge.training.segment_attention import forward_layout

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "threads": 1,
        "load_average_before": list(os.getloadavg()),
        "models": {},
    }
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = ROOT / "models" / "demo" if name == "demo" else build_30m_model(Path(tmp) / "qwen2-30m")
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        batches = layouts(*SHAPES[name], model.config.vocab_size)
        masks = [as_dense_mask(layout) for layout in batches]

        def run(kind: str) -> float:
            start = time.perf_counter()
            for layout, mask in zip(batches, masks):
                if kind == "segments":
                    forward_layout(model, layout, logits_to_keep=1).logits.sum().backward()
                else:
                    model(
                        input_ids=layout.input_ids,
                        position_ids=layout.position_ids,
                        use_cache=False,
                        logits_to_keep=1,
                        attention_mask=mask,
                    ).logits.sum().backward()
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        times = {"dense_mask": [], "segments": []}
        for round_index in range(args.rounds + 1):
            for kind in ("dense_mask", "segments") if round_index % 2 == 0 else ("segments", "dense_mask"):
                seconds = run(kind)
                if round_index:
                    times[kind].append(seconds)
        result = {
            kind: {"best_s": min(t), "median_s": statistics.median(t), "rounds_s": t} for kind, t in times.items()
        }
        result["saving_best"] = 1 - result["segments"]["best_s"] / result["dense_mask"]["best_s"]
        result.update(micro_batches=len(batches), positions=sum(layout.num_slots for layout in batches))
        results["models"][name] = result
        print(
            f"{name}: dense mask {result['dense_mask']['best_s']:.2f} s, segments {result['segments']['best_s']:.2f} s "
            f"(best of {args.rounds}; {result['saving_best']:.0%} less)",
            flush=True,
        )
    results["load_average_after"] = list(os.getloadavg())
    write_result(args.json, results)


if __name__ == "__main__":
    main()
