"""Build the demo preference pairs (data/demo/preference_{train,val}.jsonl) for `reinforge dpo` and `reinforge rm`.

Each pair is one demo word problem (see scripts/build_demo_model.py) with two worked answers:
`chosen`, the correct solution, and `rejected`, the noisy teacher's solution (each carry/borrow it
needs dropped with probability DROP_PROB, the mistake the demo model learned). Only problems whose
two solutions differ are kept, so every pair needs a carry or borrow somewhere and the rejected
answer is always wrong.

The problems continue the demo's own seeded stream past the 15,200 problems of val.jsonl,
train.jsonl and sft.jsonl, so no pair shares its arithmetic with the demo model's training data or
with the GRPO prompts, and the two splits share none either. Seeded: rerunning rewrites the same
bytes (a second or two).
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_demo_model import DROP_PROB, NUM_SFT, NUM_TRAIN, NUM_VAL, SEED, sample_problem, solution, write_jsonl  # noqa: E402

NUM_PREFERENCE_TRAIN, NUM_PREFERENCE_VAL = 4000, 200


def demo_problem_stream(rng: random.Random):
    """Problems with distinct arithmetic, in the order make_data() in build_demo_model.py draws them."""
    seen = set()
    while True:
        problem = sample_problem(rng)
        key = (tuple(problem["numbers"]), tuple(problem["ops"]))
        if key not in seen:
            seen.add(key)
            yield problem


def preference_pair(problem: dict, rng: random.Random) -> dict | None:
    """{"prompt", "chosen", "rejected"}, or None when the teacher's sampled solution is the correct one."""
    drops = [rng.random() < DROP_PROB for _ in problem["ops"]]
    chosen, rejected = solution(problem, [False] * len(problem["ops"])), solution(problem, drops)
    return None if chosen == rejected else {"prompt": problem["prompt"], "chosen": chosen, "rejected": rejected}


def make_pairs(num_train: int, num_val: int, num_demo_problems: int) -> tuple[list[dict], list[dict]]:
    problems = demo_problem_stream(random.Random(SEED))
    for _ in range(num_demo_problems):  # the demo's val, train and sft problems
        next(problems)
    teacher = random.Random(SEED + 1)
    pairs: list[dict] = []
    while len(pairs) < num_val + num_train:
        pair = preference_pair(next(problems), teacher)
        if pair is not None:
            pairs.append(pair)
    return pairs[num_val:], pairs[:num_val]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-data", type=Path, default=Path("data/demo"))
    parser.add_argument("--num-train", type=int, default=NUM_PREFERENCE_TRAIN)
    parser.add_argument("--num-val", type=int, default=NUM_PREFERENCE_VAL)
    args = parser.parse_args()
    train, val = make_pairs(args.num_train, args.num_val, NUM_VAL + NUM_TRAIN + NUM_SFT)
    write_jsonl(args.out_data / "preference_train.jsonl", train)
    write_jsonl(args.out_data / "preference_val.jsonl", val)
    print(f"wrote {len(train)} train and {len(val)} val preference pairs to {args.out_data}")


if __name__ == "__main__":
    main()
