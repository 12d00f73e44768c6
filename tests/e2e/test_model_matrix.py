"""The conformance matrix (docs/models.md): every family of tests/model_families.py, a tiny random model with its
variant settings binding at the runs' lengths, through every cell of tests/e2e/_matrix.py: SFT (its validation loss
against transformers' forward), GRPO on the HF engine in the shared-prompt, packed and padded layouts, GRPO with
LoRA, GRPO on vLLM, and the trainer as 2 FSDP2 ranks, at tp=2 and at cp=2. A cell passes with the start-up mismatch
at most 1.001 against the HF engine (1.01 against vLLM), or is refused in one line before any run directory.

EXPECTED is every cell that does not pass, with the words of its refusal ("refused: ...") or what fails today
("fails: ...", an expected failure); every other cell must pass. A cell that does better than EXPECTED says so and
fails, so the table is updated with the code: delete the entry. No traceback is ever expected.

With REINFORGE_MATRIX_OUT=FILE each cell appends its outcome to FILE as a JSON line; scripts/model_matrix.py runs
this module so and writes docs/models.md's table from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import model_families
import pytest
from _matrix import (
    CELLS,
    DOC_BEGIN,
    DOC_END,
    RECIPE_CELLS,
    ROOT,
    VLLM_CELL,
    WORLD_CELLS,
    Outcome,
    demo_data,
    run_recipe_cell,
)

FAMILIES = list(model_families.FAMILIES)
# Every cell that does not pass: a one-line refusal before any run directory ("refused: <its words>"), or what fails
# today ("fails: <why>"), an expected failure to be mended; every other cell must pass.
EXPECTED: dict[tuple[str, str], str] = {
    ("nemotron_h", "tp2"): "refused: does not support nemotron_h",
    ("qwen2", "grpo_vllm"): "refused: a sliding window on some layers only",
    ("olmo2", "grpo_vllm"): "refused: only through its Transformers backend",
    ("gpt_oss", "grpo_vllm"): "refused: gpt-oss on the CPU",
    ("deepseek_v3", "grpo_vllm"): "refused: multi-head latent attention on the CPU",
    ("nemotron_h", "cp2"): "refused: recurrent (state-space) layers, which context parallelism would cut",
}


def expected(family: str, cell: str) -> str:
    return EXPECTED.get((family, cell), "pass")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Every family's model and the demo data's slice; built once per worker (a tenth of a second each)."""
    base = tmp_path_factory.mktemp("matrix")
    models = {name: model_families.build(name, base / "models" / name) for name in FAMILIES}
    return base, models, demo_data(base / "data")


def check(family: str, cell: str, outcome: Outcome) -> None:
    """Record the outcome (REINFORGE_MATRIX_OUT) and compare it with EXPECTED."""
    out = os.environ.get("REINFORGE_MATRIX_OUT")
    if out:
        row = {"family": family, "cell": cell, "expected": expected(family, cell), **asdict(outcome)}
        with open(out, "a") as file:
            file.write(json.dumps(row) + "\n")
    want = expected(family, cell)
    assert "traceback" not in outcome.detail or want.startswith("fails"), outcome
    if want == "pass":
        assert outcome.kind == "pass", outcome
    elif want.startswith("refused: "):
        assert outcome.kind == "refused" and want.removeprefix("refused: ") in outcome.detail, outcome
    else:
        assert outcome.kind != "pass", f"{family}/{cell} passes now: delete its EXPECTED entry ({outcome.detail})"
        pytest.xfail(f"{want}: {outcome.kind}: {outcome.detail}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cell", RECIPE_CELLS)
def test_recipe_cell(inputs, tmp_path, family, cell):
    base, models, data = inputs
    check(family, cell, run_recipe_cell(cell, models[family], data, tmp_path / "run"))


@pytest.fixture(scope="module")
def vllm_outcomes(inputs):
    """Every family's vLLM cell in one child process: vLLM imported once, one engine per family. A family the
    child did not reach (it crashed) is an error naming how the child ended."""
    base, _, data = inputs
    out = base / "vllm.jsonl"
    child = [sys.executable, Path(__file__).with_name("_matrix.py"), "vllm", base / "models", data, base / "vllm", out]
    result = subprocess.run([*map(str, child), *FAMILIES], capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    outcomes = {row.pop("family"): Outcome(**row) for row in rows}
    ended = f"the vLLM cells' process ended with {result.returncode}: {result.stderr.strip()[-300:]}"
    return {name: outcomes.get(name, Outcome("error", ended)) for name in FAMILIES}


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_cell(vllm_outcomes, family):
    check(family, VLLM_CELL, vllm_outcomes[family])


@pytest.fixture(scope="module")
def world_outcomes(tmp_path_factory):
    from _matrix_world import run_world

    return run_world(FAMILIES, tmp_path_factory.mktemp("matrix_world"))


@pytest.mark.xdist_group("fsdp2_worker")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cell", WORLD_CELLS)
def test_layout_cell(world_outcomes, family, cell):
    check(family, cell, world_outcomes[family, cell])


def test_docs_models_table_says_what_expected_says():
    """docs/models.md's table is written from a run of this matrix: a cell EXPECTED to pass shows its number, a
    refusal says refused, a known failure is marked; rerun scripts/model_matrix.py when EXPECTED changes."""
    table = (ROOT / "docs" / "models.md").read_text().split(DOC_BEGIN)[1].split(DOC_END)[0]
    rows = {
        line.split("|")[1].strip(): [entry.strip() for entry in line.split("|")[3:-1]]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| family")
    }
    assert list(rows) == FAMILIES
    for family, entries in rows.items():
        for cell, entry in zip(CELLS, entries, strict=True):
            want = expected(family, cell)
            mark = "number" if want == "pass" else "refused" if want.startswith("refused") else "✗"
            shown = "number" if entry[0].isdigit() or entry.startswith("Δ") else entry.split()[0]
            assert shown == mark, f"{family}/{cell}: docs/models.md shows {entry!r}, EXPECTED says {want!r}"


def test_every_cell_is_in_one_test():
    assert set(CELLS) == {*RECIPE_CELLS, VLLM_CELL, *WORLD_CELLS}
    assert all(family in FAMILIES and cell in CELLS for family, cell in EXPECTED)
