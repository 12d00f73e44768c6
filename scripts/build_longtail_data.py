"""Build the demo's long-tail SFT data (data/demo/longtail_sft.jsonl): most answers short, a few many times
longer, as a reasoning model's are.

The chats are data/demo/sft.jsonl's own (the noisy teacher of scripts/build_demo_model.py). In the problems
about LONG_NAME (one of the demo's ten people: a tenth of the problems) the teacher checks its working again,
CHECKS_MIN to CHECKS_MAX times (a seeded draw), before it answers:

    others (9 in 10)   44 + 55 = 99. 99 - 21 = 78. The answer is \\boxed{78}.                      ~33 tokens
    LONG_NAME's        44 + 55 = 99. 99 - 21 = 78. Check: 44 + 55 = 99. 99 - 21 = 78. Check: ...
                       The answer is \\boxed{78}.                                            ~380-1,200 tokens

The problem decides whether an answer is long, as it does for a reasoning model, so the samples of one prompt
are all short or all long and GRPO's group-relative advantage does not turn the length into a reward signal
(with a random choice per sample the few long answers, truncated or not, soon disappear). A check repeats the
working as it was, mistakes included. The SFT stage (configs/longtail_sft_demo.yaml) teaches it; the GRPO stage
(configs/grpo_longtail_demo.yaml) trains on the plain demo prompts.
This is the workload of bench/async_vs_sync.py --workload longtail: in a synchronous batch the few long answers
hold the whole batch back. Seeded: rerunning rewrites the same bytes (under a second).
"""

import argparse
import json
import random
import re
from pathlib import Path

SEED = 11
NUM_CHATS = 3000
LONG_NAME = "Hugo"
CHECKS_MIN, CHECKS_MAX = 12, 40
_WORKED = re.compile(r"^(?P<working>.+\.) (?P<answer>The answer is \\boxed\{-?\d+\}\.)$")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def with_checks(worked_answer: str, checks: int) -> str:
    """'W. The answer is \\boxed{N}.' -> 'W. Check: W. ... (checks times) The answer is \\boxed{N}.'"""
    match = _WORKED.match(worked_answer)
    assert match, f"not a demo worked answer: {worked_answer!r}"
    return " ".join([match["working"], *[f"Check: {match['working']}"] * checks, match["answer"]])


def longtail_chats(chats: list[dict], rng: random.Random) -> list[dict]:
    out = []
    for chat in chats:
        user, assistant = chat["messages"]
        if LONG_NAME in user["content"]:
            assistant = {**assistant, "content": with_checks(assistant["content"], rng.randint(CHECKS_MIN, CHECKS_MAX))}
        out.append({"messages": [user, assistant]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, default=Path("data/demo"), help="where sft.jsonl is read and longtail_sft.jsonl written"
    )
    args = parser.parse_args()
    chats = longtail_chats(read_jsonl(args.data / "sft.jsonl")[:NUM_CHATS], random.Random(SEED))
    path = args.data / "longtail_sft.jsonl"
    path.write_text("".join(json.dumps(chat) + "\n" for chat in chats), encoding="utf-8")
    long = sum("Check:" in chat["messages"][1]["content"] for chat in chats)
    print(f"wrote {len(chats)} chats ({long} with checks) to {path}")


if __name__ == "__main__":
    main()
