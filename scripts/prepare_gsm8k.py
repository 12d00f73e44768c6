"""Convert GSM8K (openai/grade-school-math, MIT) to reinforge's prompt format.

No longer needed to train on GSM8K: every recipe reads the published set as it is (docs/data.md), e.g.
`data.train_path=openai/gsm8k data.subset=main data.columns.prompt=question`, or its downloaded parquet/JSONL
files with the same column setting; the math environment scores against GSM8K's `answer` ("... #### N") as
published. Kept as the record of how data/gsm8k/ was made.

    python scripts/prepare_gsm8k.py SRC_DIR data/gsm8k

reads SRC_DIR/{train,test}.jsonl (`question`, `answer` = worked solution ending in "#### N") and
writes one `{"prompt", "answer", "task": "math"}` object per line, the answer being the final N.
"""

import json
import sys
from pathlib import Path


def convert(source: Path, target: Path) -> int:
    count = 0
    with source.open() as src, target.open("w") as out:
        for line in src:
            record = json.loads(line)
            final = record["answer"].split("####")[-1].strip().replace(",", "")
            out.write(json.dumps({"prompt": record["question"], "answer": final, "task": "math"}) + "\n")
            count += 1
    return count


if __name__ == "__main__":
    source_dir, target_dir = Path(sys.argv[1]), Path(sys.argv[2])
    target_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        print(split, convert(source_dir / f"{split}.jsonl", target_dir / f"{split}.jsonl"))
