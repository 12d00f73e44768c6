"""Write the demo's data where tinker-cookbook's minimal loops look for their Hugging Face datasets.

`tinker_cookbook.recipes.sl_loop` calls `datasets.load_dataset("HuggingFaceH4/no_robots")` (split train, column
`messages`) and `tinker_cookbook.recipes.rl_loop` calls `datasets.load_dataset("openai/gsm8k", "main")` (columns
`question` and `answer`, the final number after `####`). `datasets` resolves a name that is a local directory before
the hub, so a working directory holding `HuggingFaceH4/no_robots/` and `openai/gsm8k/` makes those exact calls load
the demo's data; gsm8k's README declares the `main` config, as the hub's does.

- no_robots (train): the demo problems of data/demo/preference_train.jsonl with their *correct* worked solutions
  (`chosen`), every one needing a carry or borrow. The demo model learned the noisy teacher's chats
  (data/demo/sft.jsonl) to their floor (NLL 0.033 per reply token), so supervising it on them again would not move;
  on the correct solutions it starts at 0.086 and sl_loop's loss has somewhere to fall: it teaches the carry.
- gsm8k (main): train from data/demo/train.jsonl, test from data/demo/val.jsonl, `answer` = `#### <true result>`.

`python scripts/tinker_cookbook_data.py DIR` writes them (a second or two; the runner scripts/run_tinker_cookbook.py
and the tests call `write_datasets`). `rl_loop_prompt` is the prompt rl_loop builds for a question, taken from the
installed recipe's own source so that models/tinker_demo is trained on exactly what rl_loop sends.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = ROOT / "data" / "demo"
# The name the demo is served under: the cookbook picks a renderer by name, and this one's (`qwen3_instruct`) writes
# the demo's chat template byte for byte.
MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"
SFT_DATASET, RL_DATASET, RL_CONFIG = "HuggingFaceH4/no_robots", "openai/gsm8k", "main"
GSM8K_README = f"""---
configs:
- config_name: {RL_CONFIG}
  data_files:
  - split: train
    path: train.jsonl
  - split: test
    path: test.jsonl
---
The reinforge demo's arithmetic problems in GSM8K's columns (written by scripts/tinker_cookbook_data.py).
"""


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def sl_chats() -> list[dict]:
    """sl_loop's chats: the demo's problems with their correct worked solutions."""
    return [
        {
            "messages": [
                {"role": "user", "content": pair["prompt"]},
                {"role": "assistant", "content": pair["chosen"]},
            ]
        }
        for pair in _read_jsonl(DEMO_DATA / "preference_train.jsonl")
    ]


def gsm8k_records(name: str) -> list[dict]:
    """rl_loop's problems (data/demo/NAME.jsonl) as GSM8K rows: the question and `#### <answer>`."""
    records = _read_jsonl(DEMO_DATA / f"{name}.jsonl")
    return [{"question": r["prompt"], "answer": f"#### {r['answer']}"} for r in records]


def write_datasets(out_dir: Path, num_rl_problems: int | None = None) -> Path:
    """Both datasets under `out_dir` (the directory to run the recipes in); returns it. `num_rl_problems`: gsm8k's
    train split holds only the first that many problems, cycled to its full length (rl_loop goes through the split
    in order, so every batch then draws from the same few problems: a reward that rises within a few steps, for
    tests)."""
    _write_jsonl(out_dir / SFT_DATASET / "train.jsonl", sl_chats())
    gsm8k, train = out_dir / RL_DATASET, gsm8k_records("train")
    if num_rl_problems:
        train = [train[i % num_rl_problems] for i in range(len(train))]
    _write_jsonl(gsm8k / "train.jsonl", train)
    _write_jsonl(gsm8k / "test.jsonl", gsm8k_records("val"))
    (gsm8k / "README.md").write_text(GSM8K_README)
    return out_dir


def rl_loop_prompt(question: str) -> list[dict]:
    """The conversation rl_loop samples from for `question`: its few-shot prefix, then the question and its suffix."""
    prefix, suffix = rl_loop_strings()
    return [*prefix, {"role": "user", "content": question + suffix}]


@functools.cache
def rl_loop_strings() -> tuple[list[dict], str]:
    """rl_loop's `convo_prefix` and `question_suffix`, read from the installed recipe's source: a cookbook release
    that changes them changes what models/tinker_demo is built on, not a copy here that drifts."""
    from tinker_cookbook.recipes import rl_loop

    values: dict = {}
    for node in ast.walk(ast.parse(inspect.getsource(rl_loop.main))):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] in (
            ["question_suffix"],
            ["convo_prefix"],
        ):
            name = node.targets[0].id
            values[name] = eval(compile(ast.Expression(node.value), "rl_loop", "eval"), {}, dict(values))
    if set(values) != {"question_suffix", "convo_prefix"}:
        raise SystemExit("tinker_cookbook.recipes.rl_loop no longer assigns question_suffix and convo_prefix")
    return values["convo_prefix"], values["question_suffix"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path, help="the directory to run the recipes in")
    parser.add_argument("--rl-problems", type=int, help="gsm8k's train split: only the first N problems, cycled")
    args = parser.parse_args()
    write_datasets(args.out_dir, args.rl_problems)
    print(f"wrote {args.out_dir / SFT_DATASET} and {args.out_dir / RL_DATASET}")


if __name__ == "__main__":
    main()
