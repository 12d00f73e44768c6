"""Host memory of the training backends' layout cache (training/micro_batching.py, `LayoutCache`), per token.

    python bench/layout_cache_memory.py --json bench/results/layout_cache_memory.json

A GRPO-shaped batch (`_common.grpo_like_batch`: 32 prompts x 8 samples, 30-41 prompt tokens, answers of
the given lengths), planned into micro-batches of 4096 tokens and selected by the backends' own code,
each micro-batch laid out through a fresh `LayoutCache`, with shared prompts and without. Reported: the
bytes of every tensor a cached layout holds (input ids, positions, token index, the segments' indices and
validity; the masks are not kept, `RowLayout.to` builds them per pass) over the tokens laid out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import grpo_like_batch, write_result  # noqa: E402


def layout_bytes(layout) -> int:
    tensors = [layout.input_ids, layout.position_ids, layout.token_index]
    tensors += [
        t
        for bucket in layout.segments
        for t in (bucket.query_index, bucket.key_index, bucket.query_valid, bucket.key_valid)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(answer_tokens: tuple[int, int], share_prompts: bool) -> dict:
    from reinforge.training.base import TrainingConfig
    from reinforge.training.micro_batching import LayoutCache, Prompts, plan_micro_batches, select_micro_batch

    batch = grpo_like_batch(256, (30, 41), answer_tokens, 449, 8, shared_prompts=True)
    config = TrainingConfig(
        global_batch_size=256, micro_batch_size=256, micro_batch_tokens=4096, share_prompts=share_prompts
    )
    cache = LayoutCache()
    for rows in plan_micro_batches(batch.attention_mask.sum(1).tolist(), config, Prompts.of(batch, config)):
        micro, local_rows, _ = select_micro_batch(batch, rows)
        cache.get(
            micro.input_ids,
            micro.attention_mask.sum(1).tolist(),
            local_rows,
            micro.prompt_lengths.tolist() if share_prompts else None,
        )
    num_bytes = sum(layout_bytes(layout) for layout in cache.layouts.values())
    return {
        "answer_tokens": list(answer_tokens),
        "share_prompts": share_prompts,
        "micro_batches": len(cache.layouts),
        "tokens": cache.num_tokens,
        "bytes": num_bytes,
        "bytes_per_token": num_bytes / cache.num_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "layout_cache_memory.json")
    args = parser.parse_args()
    results = [measure(answer, share) for answer in ((30, 48), (8, 400)) for share in (True, False)]
    for r in results:
        print(
            f"answers {r['answer_tokens'][0]}-{r['answer_tokens'][1]} tokens, shared prompts {r['share_prompts']}: "
            f"{r['bytes_per_token']:.1f} bytes per token ({r['tokens']} tokens in {r['micro_batches']} micro-batches)"
        )
    write_result(args.json, {"date": time.strftime("%Y-%m-%d"), "results": results})


if __name__ == "__main__":
    main()
