"""The evaluation benchmarks: each one's file in data/benchmarks/, its prompt format and its scorer.

A benchmark loads into `BenchmarkItem`s: the user message sent to the model (`prompt`, rendered with
the model's chat template, no system prompt) and the `record` its environment scores the response
against (`record["task"]` names the environment). The files are described, with their sources, in
data/benchmarks/README.md. Items keep the file's order; `limit` takes the first ones.

Prompt formats (`{...}` are the file's fields):

- gsm8k, math500, aime2024, aime2025 (env `math`): `{question or problem}` + "\\n\\n" + MATH_SUFFIX,
  the instruction of Qwen2.5-Math and DeepSeek-R1's evaluations. The gold answer is GSM8K's number
  after "#### " (thousands commas dropped), MATH-500's `answer`, AIME's integer `answer`.
- humaneval (env `code`): HUMANEVAL_INSTRUCTION, then the HumanEval `prompt` (signature and
  docstring) in a ```python block. The code env runs the HumanEval prompt before the program, so a
  response may give the whole function or only its body; it then runs `check(candidate)`.
- mbpp (env `code`): `{prompt}`, then "Your code should pass this test:" and the first of the
  record's `test_list` in a ```python block, as MBPP's paper and the EvalPlus/bigcode prompts show
  one test to fix the function's name and signature; then MBPP_INSTRUCTION. All of `test_list`
  (with `test_imports` run first) is scored.
- ifeval (env `ifeval`): IFEval's `prompt` as it is, no suffix (the instructions are the prompt).
  Scored in IFEval's strict mode, prompt level (1 when every instruction is followed).
- vlm_sums (env `math`, images): the vision-language demo's held-out pictures of two numbers to add
  (scripts/build_vlm_demo.py), `{question}` as it is, the `images` beside the file.
- Questions of your own (`--benchmark path/to/file.jsonl`; or a JSON, parquet or arrow file, a directory saved by
  `datasets`, or a hub dataset name `owner/name` with `--split` and `--subset`, all read by data/sources.py, whose
  `--column FIELD=COLUMN` renames): each row's `question` (or `prompt`) as it is, its `answer`, and optionally
  `images` (paths relative to the file, data URLs, or a `datasets` Image column; a vision-language model) and `task`
  (the environment, default `math`, whose answers are also voted on for maj@k).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from reinforge.data.jsonl import read_jsonl
from reinforge.data.sources import FILE_SUFFIXES, Row, Source, SourceConfig
from reinforge.errors import DataError, ReinforgeError
from reinforge.paths import PROJECT_ROOT

BENCHMARKS_DIR = PROJECT_ROOT / "data" / "benchmarks"
VLM_SUMS_DIR = BENCHMARKS_DIR / "vlm_sums"
MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function, signature included, in a "
    "```python code block."
)
MBPP_INSTRUCTION = "Write the function in a ```python code block."


@dataclass
class BenchmarkItem:
    """One benchmark question."""

    id: str  # the file's own id (task_id, unique_id, key) or "<benchmark>/<line index>"
    prompt: str  # the user message sent to the model
    record: dict[str, Any]  # what the environment scores against: `task` plus its fields
    images: list[str] = field(default_factory=list)  # image references (data/images.py), shown before the prompt
    base_dir: Path = BENCHMARKS_DIR  # where relative image paths start: the benchmark file's directory


@dataclass(frozen=True)
class Benchmark:
    name: str
    file: str  # under data/benchmarks/
    task: str  # the environment that scores it
    has_final_answer: bool  # a math answer to extract and vote on (maj@k)
    to_items: Callable[[list[dict[str, Any]]], list[BenchmarkItem]]
    source: Source | None = None  # questions of the user's own (`file` is then the path or hub name as given)


def _math_prompt(problem: str) -> str:
    return f"{problem}\n\n{MATH_SUFFIX}"


def _gsm8k(rows: list[dict[str, Any]]) -> list[BenchmarkItem]:
    return [
        BenchmarkItem(
            f"gsm8k/{i}",
            _math_prompt(row["question"]),
            {"task": "math", "answer": row["answer"].split("####")[-1].strip().replace(",", "")},
        )
        for i, row in enumerate(rows)
    ]


def _math500(rows: list[dict[str, Any]]) -> list[BenchmarkItem]:
    return [
        BenchmarkItem(row["unique_id"], _math_prompt(row["problem"]), {"task": "math", "answer": row["answer"]})
        for row in rows
    ]


def _aime(rows: list[dict[str, Any]]) -> list[BenchmarkItem]:
    return [
        BenchmarkItem(row["id"], _math_prompt(row["problem"]), {"task": "math", "answer": str(row["answer"])})
        for row in rows
    ]


def _humaneval(rows: list[dict[str, Any]]) -> list[BenchmarkItem]:
    return [
        BenchmarkItem(
            row["task_id"],
            f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{row['prompt'].rstrip()}\n```",
            {"task": "code", **{key: row[key] for key in ("task_id", "prompt", "test", "entry_point")}},
        )
        for row in rows
    ]


def _mbpp(rows: list[dict[str, Any]]) -> list[BenchmarkItem]:
    return [
        BenchmarkItem(
            f"mbpp/{row['task_id']}",
            f"{row['prompt']}\nYour code should pass this test:\n\n"
            f"```python\n{row['test_list'][0]}\n```\n\n{MBPP_INSTRUCTION}",
            {
                "task": "code",
                "task_id": row["task_id"],
                "test_list": row["test_list"],
                "test_imports": row["test_imports"],
            },
        )
        for row in rows
    ]


def _ifeval(rows: list[dict[str, Any]]) -> list[BenchmarkItem]:
    return [
        BenchmarkItem(
            f"ifeval/{row['key']}",
            row["prompt"],
            {"task": "ifeval", **{key: row[key] for key in ("key", "prompt", "instruction_id_list", "kwargs")}},
        )
        for row in rows
    ]


def _questions(rows: list[dict[str, Any]], name: str, base_dir: Path) -> list[BenchmarkItem]:
    """Rows of `question` (or `prompt`), `answer`, optional `images` and `task` (default math)."""
    return _question_items([Row(row, f"{name}: row {i}", tuple(row)) for i, row in enumerate(rows)], name, base_dir)


def _question_items(rows: list[Row], name: str, base_dir: Path) -> list[BenchmarkItem]:
    items = []
    for i, found in enumerate(rows):
        row = found.record
        question = row.get("question", row.get("prompt"))
        if not isinstance(question, str) or "answer" not in row:
            raise DataError(f"{found.where}: needs a `question` (or `prompt`) string and an `answer`")
        images = row.get("images", row.get("image", []))
        images = [images] if isinstance(images, str) else list(images)
        record = {"task": row.get("task", "math"), "answer": str(row["answer"])}
        items.append(BenchmarkItem(str(row.get("id", f"{name}/{i}")), question, record, images, base_dir))
    return items


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("gsm8k", "gsm8k/test.jsonl", "math", True, _gsm8k),
        Benchmark("math500", "math500/test.jsonl", "math", True, _math500),
        Benchmark("aime2024", "aime2024/aime_2024.jsonl", "math", True, _aime),
        Benchmark("aime2025", "aime2025/aime_2025.jsonl", "math", True, _aime),
        Benchmark("humaneval", "humaneval/HumanEval.jsonl", "code", False, _humaneval),
        Benchmark("mbpp", "mbpp/sanitized-mbpp.json", "code", False, _mbpp),
        Benchmark("ifeval", "ifeval/input_data.jsonl", "ifeval", False, _ifeval),
        Benchmark(
            "vlm_sums", "vlm_sums/test.jsonl", "math", True, lambda rows: _questions(rows, "vlm_sums", VLM_SUMS_DIR)
        ),
    )
}


def get_benchmark(name: str, data: SourceConfig | None = None) -> Benchmark:
    """A named benchmark, or questions of the user's own read by data/sources.py with `data`'s split, subset and
    columns (the module doc)."""
    if name in BENCHMARKS:
        return BENCHMARKS[name]
    source = Source.train(data or SourceConfig(split="test"), name, "--benchmark")
    if "/" not in name and Path(name).suffix not in FILE_SUFFIXES and not Path(name).exists():
        raise ReinforgeError(
            f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}, or give a file of questions (.jsonl, "
            ".json, .parquet, .arrow), a directory saved by datasets, or a hub dataset name (owner/name)"
        )
    task = next(source.rows()).record.get("task", "math")
    return Benchmark(name, name, task, task == "math", lambda rows: [], source)


def load_benchmark(
    name: str, limit: int | None = None, root: Path = BENCHMARKS_DIR, data: SourceConfig | None = None
) -> list[BenchmarkItem]:
    """The benchmark's items in file order, the first `limit` of them when given."""
    if limit is not None and limit < 1:
        raise ReinforgeError(f"--limit must be >= 1, got {limit}")
    benchmark = get_benchmark(name, data)
    if benchmark.source is not None:  # read no further than the limit: a hub set may be large
        rows = list(itertools.islice(benchmark.source.rows(), limit))
        return _question_items(rows, name, benchmark.source.base_dir)
    path = root / benchmark.file
    if path.suffix == ".json":  # MBPP's sanitized split is one JSON array
        if not path.is_file():
            raise DataError(f"benchmark file {path} does not exist")
        rows = json.loads(path.read_text(encoding="utf-8"))
    else:
        rows = read_jsonl(path)
    if limit is not None:
        rows = rows[:limit]
    return benchmark.to_items(rows)
