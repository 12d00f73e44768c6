"""Build the demo reasoning-control data (data/demo/reasoning_*.jsonl): the same arithmetic problems,
answered with "detailed thinking on" or "off" as Llama-Nemotron's system prompts switch them
(Bercovich et al. 2025, arXiv:2505.00949).

- `reasoning_sft.jsonl`: chats for `reinforge sft`. Each of NUM_SFT_PROBLEMS problems of
  data/demo/sft.jsonl appears twice, once per mode, so that only the system prompt tells the two
  answers apart:

      system "detailed thinking on"   ->  <think>44 + 55 = 99. 99 - 21 = 78.</think>\\nThe answer is \\boxed{78}.
      system "detailed thinking off"  ->  The answer is \\boxed{78}.

  The working is sft.jsonl's own, i.e. the noisy teacher that drops carries (scripts/build_demo_model.py),
  so the SFT teaches the switch, not better arithmetic: that is left to GRPO's math reward. No "off"
  answer shows its working, even untagged: the format reward allows that, and the math reward, which
  pays working answers far more often, would then grow it into "thinking on without the tags".
- `reasoning_train.jsonl`: GRPO prompts, the first NUM_TRAIN records of data/demo/train.jsonl, half of
  them (a seeded choice) "on" and half "off": `{"prompt", "answer", "task": "math", "thinking",
  "system"}`. `thinking` is what the format environment checks; `system` is the system message the
  prompt is rendered with (data.columns.system).
- `reasoning_val.jsonl`: every problem of data/demo/val.jsonl twice, "on" then "off", so the first n
  records of the file (data.max_val_prompts) always hold both modes equally.

The three share no problem (the demo files they come from share none). Seeded: rerunning rewrites the
same bytes (under a second).
"""

import argparse
import json
import random
import re
from pathlib import Path

SEED = 6
NUM_SFT_PROBLEMS = 800  # 1,600 chats
NUM_TRAIN = 1000
SYSTEM = {"on": "detailed thinking on", "off": "detailed thinking off"}
_WORKED = re.compile(r"^(?P<working>.+\.) (?P<answer>The answer is \\boxed\{-?\d+\}\.)$")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def split_worked_answer(text: str) -> tuple[str, str]:
    """'44 + 55 = 99. 99 - 21 = 78. The answer is \\boxed{78}.' -> (the working, 'The answer is \\boxed{78}.')."""
    match = _WORKED.match(text)
    assert match, f"not a demo worked answer: {text!r}"
    return match["working"], match["answer"]


def reply(mode: str, worked_answer: str) -> str:
    """The assistant's answer in one mode."""
    working, answer = split_worked_answer(worked_answer)
    return f"<think>{working}</think>\n{answer}" if mode == "on" else answer


def sft_chats(chats: list[dict], rng: random.Random) -> list[dict]:
    """Both modes of each chat, in a seeded order."""
    out = []
    for chat in chats:
        user, assistant = chat["messages"]
        for mode in ("on", "off"):
            content = reply(mode, assistant["content"])
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM[mode]},
                        user,
                        {"role": "assistant", "content": content},
                    ]
                }
            )
    rng.shuffle(out)
    return out


def with_mode(record: dict, mode: str) -> dict:
    return {**record, "thinking": mode, "system": SYSTEM[mode]}


def prompt_records(records: list[dict], rng: random.Random) -> list[dict]:
    """Exactly half "on" (a seeded choice of which), in the file's order."""
    modes = ["on", "off"] * (len(records) // 2) + ["on"] * (len(records) % 2)
    rng.shuffle(modes)
    return [with_mode(record, mode) for record, mode in zip(records, modes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, default=Path("data/demo"), help="where the demo files are read and these written"
    )
    args = parser.parse_args()
    rng = random.Random(SEED)
    sft = sft_chats(read_jsonl(args.data / "sft.jsonl")[:NUM_SFT_PROBLEMS], rng)
    train = prompt_records(read_jsonl(args.data / "train.jsonl")[:NUM_TRAIN], rng)
    val = [with_mode(record, mode) for record in read_jsonl(args.data / "val.jsonl") for mode in ("on", "off")]
    write_jsonl(args.data / "reasoning_sft.jsonl", sft)
    write_jsonl(args.data / "reasoning_train.jsonl", train)
    write_jsonl(args.data / "reasoning_val.jsonl", val)
    print(f"wrote {len(sft)} chats, {len(train)} train and {len(val)} val prompts to {args.data}/reasoning_*.jsonl")


if __name__ == "__main__":
    main()
