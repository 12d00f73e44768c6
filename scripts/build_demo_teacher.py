"""Build the distillation demo's teacher (models/demo_teacher): models/demo trained further on correct answers.

models/demo learnt from a noisy teacher that drops the carry (+) or borrow (-) 60% of the time
(scripts/build_demo_model.py). This script takes models/demo and continues its supervised fine-tuning on
the same prompts of data/demo/sft.jsonl with every answer worked out *correctly* (the operands are read
back from the noisy solution, the chain recomputed with no carry dropped), so the teacher keeps the
student's tokenizer and size but gets most carry problems right. `reinforge distill --config
configs/distill_demo.yaml` then distils it into a fresh copy of models/demo on the GRPO demo's prompts.

Seeded like the demo build; `python scripts/build_demo_teacher.py` rebuilds the committed files (a few
minutes on 2 CPU cores).
"""

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_demo_model as base  # noqa: E402

STEP = re.compile(r"(\d+) ([+-]) (\d+) = -?\d+\.")


def corrected(chat: dict) -> dict:
    """The chat with its reply worked out with every carry and borrow kept."""
    steps = STEP.findall(chat["messages"][1]["content"])
    problem = {"numbers": [int(steps[0][0])] + [int(right) for _, _, right in steps], "ops": [op for _, op, _ in steps]}
    reply = base.solution(problem, [False] * len(problem["ops"]))
    return {"messages": [chat["messages"][0], {"role": "assistant", "content": reply}]}


def write_model_card(out: Path, stats: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(f"""# reinforge demo teacher

The teacher of the on-policy distillation demo (`configs/distill_demo.yaml`): `models/demo` (same
0.91M-parameter Qwen2, same tokenizer) fine-tuned further for {stats["sft_steps"]} steps (batch 64, peak lr
{stats["peak_lr"]:g}, the demo build's warm-up and cosine schedule) on the prompts of `data/demo/sft.jsonl`
with every answer worked out correctly (the noisy teacher's dropped carries and borrows put back).

**Accuracy on data/demo/val.jsonl** (true answers): greedy {stats["greedy_accuracy"]:.3f} on {stats["num_val"]} prompts
(models/demo: 0.515); temperature 1 {stats["sampled_accuracy"]:.3f} on 100 prompts x 4 samples (models/demo: 0.432).
Build time: {stats["build_seconds"] / 60:.1f} min on {torch.get_num_threads()} CPU threads.

**Rebuild:** `python scripts/build_demo_teacher.py` (seeded; reads models/demo and data/demo/sft.jsonl).
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, default=Path("models/demo"))
    parser.add_argument("--sft-data", type=Path, default=Path("data/demo/sft.jsonl"))
    parser.add_argument("--val-data", type=Path, default=Path("data/demo/val.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("models/demo_teacher"))
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--peak-lr", type=float, default=1e-3)
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(base.SEED)
    torch.set_num_threads(args.num_threads)  # the same count reproduces the same floats
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    chats = [corrected(json.loads(line)) for line in args.sft_data.read_text().splitlines()]
    examples = [base.tokenize_chat(tokenizer, chat) for chat in chats]
    base.sft(model, examples, tokenizer.pad_token_id, args.sft_steps, batch_size=64, peak_lr=args.peak_lr)
    val = [json.loads(line) for line in args.val_data.read_text().splitlines()]
    random.seed(base.SEED)
    stats = {
        "sft_steps": args.sft_steps,
        "peak_lr": args.peak_lr,
        "num_val": len(val),
        "greedy_accuracy": base.accuracy(model, tokenizer, val, num_samples=1, temperature=None),
        "sampled_accuracy": base.accuracy(model, tokenizer, val[:100], num_samples=4, temperature=1.0),
    }
    print(
        f"val greedy accuracy {stats['greedy_accuracy']:.3f}; "
        f"temperature-1 sampled accuracy {stats['sampled_accuracy']:.3f}"
    )
    stats["build_seconds"] = time.time() - start
    write_model_card(args.out, stats)  # first: it makes the directory
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)  # keep chat_template in tokenizer_config.json
    print(f"wrote {args.out} in {stats['build_seconds']:.0f}s")


if __name__ == "__main__":
    main()
