"""Run the conformance matrix (tests/e2e/test_model_matrix.py) and write docs/models.md's table from its results.

    python scripts/model_matrix.py                      # run the matrix on 2 pytest workers, then write the table
    python scripts/model_matrix.py --results cells.jsonl  # write the table from an earlier run's results

The matrix's tests write each cell's outcome as a JSON line to $REINFORGE_MATRIX_OUT (family, cell, kind, detail,
mismatch, seconds, expected); this script keeps them in --results (default runs/model_matrix.jsonl) and replaces
what lies between docs/models.md's two matrix markers with the table of every family x cell and the notes that
quote each refusal and failure. It prints each cell's wall time, and exits non-zero when a cell's test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

from _matrix import CELLS, DOC_BEGIN, DOC_END, MISMATCH, SFT_LOSS_TOLERANCE  # noqa: E402
from model_families import FAMILIES  # noqa: E402
from test_model_matrix import expected  # noqa: E402

DOC = ROOT / "docs" / "models.md"
HEADINGS = {
    "sft": "SFT",
    "grpo_hf": "GRPO, HF engine, prompts shared",
    "grpo_hf_packed": "GRPO, HF, packed",
    "grpo_hf_padded": "GRPO, HF, padded",
    "lora": "LoRA",
    "grpo_vllm": "GRPO, vLLM",
    "fsdp2": "FSDP2, 2 ranks",
    "tp2": "tp=2",
    "cp2": "cp=2",
}


def run_matrix(results: Path) -> int:
    results.parent.mkdir(parents=True, exist_ok=True)
    results.unlink(missing_ok=True)
    env = {**os.environ, "REINFORGE_MATRIX_OUT": str(results), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "tests/e2e/test_model_matrix.py", "-n", "2", "--dist", "loadgroup"]
    command += ["-k", "not test_docs_models_table"]  # the table this run is about to write
    return subprocess.run([*command, "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env).returncode


def read_results(results: Path) -> dict[tuple[str, str], dict]:
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(row["family"], row["cell"]): row for row in rows}


def cell_text(row: dict | None, notes: list[str]) -> str:
    """A cell's entry: its number when it passes; else a mark and the number of the note that quotes the run's line
    and, for a known failure, why it fails (the test module's EXPECTED)."""
    if row is None:
        return "not run"
    if row["kind"] == "pass":
        return f"Δ {row['mismatch']:.0e}" if row["cell"] == "sft" else f"{row['mismatch']:.6f}"
    want = expected(row["family"], row["cell"])  # today's EXPECTED, whatever the run's was
    refused = row["kind"] == "refused" and want.startswith("refused")
    why = "" if refused or want == "pass" else f" ({want.removeprefix('fails: ')})"
    line = f"{row['kind']}: {row['detail']}{why}".replace("|", "/").replace("`", "'")
    if line not in notes:
        notes.append(line)
    value = f" {row['mismatch']:.3g}" if row["kind"] == "mismatch" else f" {row['kind']}"
    return f"{'refused' if refused else '✗' + value} [{notes.index(line) + 1}]"


def table(rows: dict[tuple[str, str], dict]) -> str:
    notes: list[str] = []
    lines = [
        "| family | what the tiny model exercises | " + " | ".join(HEADINGS[cell] for cell in CELLS) + " |",
        "|---" * (len(CELLS) + 2) + "|",
    ]
    for name, family in FAMILIES.items():
        cells = [cell_text(rows.get((name, cell)), notes) for cell in CELLS]
        lines.append(f"| {name} | {family.variants or '-'} | " + " | ".join(cells) + " |")
    lines += ["", "Notes: each refusal's line (and each known failure's, with why) as the run reported it:", ""]
    lines += [f"{number}. {note}" for number, note in enumerate(notes, 1)]
    legend = (
        f"A number is the cell's start-up mismatch (`train/token_mult_prob_error` of the first step), at most "
        f"{MISMATCH['hf']} against the HF engine and {MISMATCH['vllm']} against vLLM to pass; SFT's is the "
        f"difference of its validation loss from transformers' own forward (at most {SFT_LOSS_TOLERANCE:g}). "
        "✗: above the threshold, an error, or a refusal that is not one line before any run directory; refused: a "
        "one-line error before any run directory (the layout cells' are the ranks' own line, which `reinforge grpo` "
        "and `reinforge sft` give from the model's config before their run directory: training/parallel/layout.py, "
        "`check_model_layout`)."
    )
    return "\n".join([legend, "", *lines])


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(DOC_BEGIN)
    _, tail = rest.split(DOC_END)
    DOC.write_text(f"{head}{DOC_BEGIN}\n{text}\n{DOC_END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="the cells' JSON lines: write the table from these, run nothing")
    args = parser.parse_args()
    status = 0
    results = args.results
    if results is None:
        results = ROOT / "runs" / "model_matrix.jsonl"
        status = run_matrix(results)
    rows = read_results(results)
    for (family, cell), row in sorted(rows.items(), key=lambda item: -item[1]["seconds"]):
        print(f"{family:12} {cell:15} {row['kind']:9} {row['seconds']:6.1f} s")
    write_doc(table(rows))
    print(f"wrote {DOC.relative_to(ROOT)} from {len(rows)} cells ({results})")
    return status


if __name__ == "__main__":
    sys.exit(main())
