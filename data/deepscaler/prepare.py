"""Write data/deepscaler/{train,aime2024}.jsonl: the DeepScaleR parts we have, as NeMo-RL prompts them.

    python data/deepscaler/prepare.py DEEPSCALER_TRAIN_DIR data/benchmarks/aime2024/aime_2024.jsonl data/deepscaler

reads DEEPSCALER_TRAIN_DIR/{aime,math}.json (agentica-project/deepscaler `deepscaler/data/train/`, MIT)
and the AIME 2024 file (eth-sri/matharena, assembled; MIT), and writes one
`{"prompt", "answer", "task": "math", "source"}` object per line. The prompt is NeMo-RL's
`examples/prompts/cot.txt` filled with the problem, character for character (its doubled backslash
before `boxed` included), because reinforge has no prompt-template setting: DeepScaleR's recipe in
NeMo-RL applies this template to every training and validation prompt. Records without an answer
(4 in math.json) are dropped. Deterministic: the same inputs give byte-identical files.
"""

import json
import sys
from pathlib import Path

# NeMo-RL examples/prompts/cot.txt after str.format(problem): the file's `{{}}` becomes `{}`, its `\\` stays.
COT_TEMPLATE = "Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{{}} tags.\n{}\n\nLet's think step-by-step"


def record(problem: str, answer: str, source: str) -> str:
    return json.dumps({"prompt": COT_TEMPLATE.format(problem), "answer": answer, "task": "math", "source": source}) + "\n"


def write_train(source_dir: Path, target: Path) -> int:
    lines = []
    for name in ("aime", "math"):
        for item in json.loads((source_dir / f"{name}.json").read_text()):
            answer = (item.get("answer") or "").strip()
            if answer:
                lines.append(record(item["problem"], answer, f"deepscaler/{name}"))
    target.write_text("".join(lines))
    return len(lines)


def write_aime2024(source: Path, target: Path) -> int:
    items = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    target.write_text("".join(record(item["problem"], str(item["answer"]), f"aime2024/{item['id']}") for item in items))
    return len(items)


if __name__ == "__main__":
    deepscaler_dir, aime2024, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    print("train.jsonl", write_train(deepscaler_dir, out / "train.jsonl"))
    print("aime2024.jsonl", write_aime2024(aime2024, out / "aime2024.jsonl"))
