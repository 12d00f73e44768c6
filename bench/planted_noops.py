"""Planted no-ops: does the suite notice when a parallel plan silently does nothing?

For each plan function of `PLANTS`, the project is copied to a temporary directory, the function's body (its
docstring kept) replaced by a no-op that returns what the callers expect, and the plan's test files run against
that copy (`PYTHONPATH` the copy: the rank processes the tests spawn import it too). A plant is `caught` when at
least one test fails or errors, `missed` when all pass. The suite itself never patches the project's code: this
script is the check that its tests can fail (issue 45: a skipped `tensor_parallelize` at tp=2 on 2 ranks used to
pass, both ranks training the same rows). One plant at a time; each runs its files' multi-rank worlds (minutes).

    python bench/planted_noops.py --json bench/results/planted_noops.json
    python bench/planted_noops.py --plants split_context   # one of them; the file keeps the others' results
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, write_result  # noqa: E402

MARK = "# planted no-op (bench/planted_noops.py)"
# name: (file, function, the no-op body, the test files that must notice), None: not in the code yet
PLANTS: dict[str, tuple[str, str, str, list[str]] | None] = {
    "tensor_parallelize": (
        "reinforge/training/parallel/tensor_plan.py",
        "tensor_parallelize",
        "return model",
        ["tests/unit/test_tensor_parallel.py", "tests/unit/test_tensor_parallel_families.py"],
    ),
    "split_context": (
        "reinforge/training/parallel/context.py",
        "split_context",
        "return None",
        ["tests/unit/test_tensor_parallel.py", "tests/unit/test_expert_parallel.py"],
    ),
    "shard_experts": (
        "reinforge/training/parallel/expert.py",
        "shard_experts",
        "return []",
        ["tests/unit/test_expert_parallel.py", "tests/unit/test_tensor_parallel_families.py"],
    ),
    # the pipeline's stage split kept as a no-op: every stage keeps every layer, its embedding and its heads (the
    # hooks that feed a stage its received hidden states stay, so the pass runs)
    "pipeline_split_stage": (
        "reinforge/training/parallel/pipeline.py",
        "split_stage",
        "info = Stage(stage, pp, range(len(decoder_layers(model))), False); "
        "model.get_decoder().register_forward_pre_hook(_receive_hook(info), with_kwargs=True); "
        "model.get_decoder().register_forward_hook(_catch_hook(info)); _STAGES[model] = info; return info",
        ["tests/unit/test_pipeline_parallel.py"],
    ),
}
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "results", "*.pyc")


def plant(path: Path, function: str, body: str) -> None:
    """`function`'s body in the file at `path` (a module-level def) replaced by `body`, its docstring kept."""
    source = path.read_text()
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    statements = node.body
    docstring = isinstance(statements[0], ast.Expr) and isinstance(getattr(statements[0], "value", None), ast.Constant)
    first = statements[1] if docstring else statements[0]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    lines[first.lineno - 1 : node.end_lineno] = [f"{indent}{body}  {MARK}\n"]
    path.write_text("".join(lines))


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | error | skipped, the first line of the failure's message)} from pytest's JUnit
    XML."""
    if not report.exists():
        return {}
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        child = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        kind = "passed" if child is None else {"failure": "failed"}.get(child.tag, child.tag)
        message = "" if child is None else (child.get("message") or "").strip().splitlines()[:1]
        result[f"{case.get('classname')}::{case.get('name')}"] = (kind, message[0][:300] if message else "")
    return result


def run_plant(name: str, spec, timeout_s: int, keep: bool) -> dict:
    file, function, body, tests = spec
    copy = Path(tempfile.mkdtemp(prefix=f"planted_{name}_"))
    try:
        shutil.copytree(ROOT, copy, ignore=IGNORED, dirs_exist_ok=True)
        plant(copy / file, function, body)
        env = dict(os.environ, PYTHONPATH=str(copy))
        check = f"import inspect, reinforge.{file[len('reinforge/') : -3].replace('/', '.')} as m; "
        check += f"print(m.__file__); assert {MARK!r} in inspect.getsource(m.{function})"
        imported = subprocess.run([sys.executable, "-c", check], cwd=copy, env=env, capture_output=True, text=True)
        assert imported.returncode == 0 and imported.stdout.startswith(str(copy)), imported.stderr or imported.stdout
        report = copy / "report.xml"
        command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
            returncode, tail = done.returncode, done.stdout[-3000:]
        except subprocess.TimeoutExpired as timeout:
            returncode, tail = None, f"timed out after {timeout_s} s\n{(timeout.stdout or b'')[-2000:]!r}"
        seconds = round(time.monotonic() - start, 1)
        tests_run = outcomes(report)
        noticed = {t: f"{kind}: {why}" for t, (kind, why) in sorted(tests_run.items()) if kind in ("failed", "error")}
        status = "caught" if noticed or returncode not in (0, None) else "missed"
        status = "timed out" if returncode is None and not noticed else status
        print(f"{name}: {status} ({len(noticed)} of {len(tests_run)} tests failed, {seconds} s)", flush=True)
        return {
            "file": file, "function": function, "no_op": body, "tests": tests, "status": status,
            "noticed_by": noticed, "tests_run": len(tests_run), "pytest_returncode": returncode,
            "seconds": seconds, "pytest_tail": tail.splitlines()[-12:],
        }  # fmt: skip
    finally:
        if not keep:
            shutil.rmtree(copy, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plants", default=",".join(PLANTS), help="comma-separated names of PLANTS")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "planted_noops.json")
    parser.add_argument("--timeout-s", type=int, default=3600, help="per plant")
    parser.add_argument("--keep", action="store_true", help="keep the planted copies (their paths are printed)")
    args = parser.parse_args()
    results = {}
    for name in args.plants.split(","):
        spec = PLANTS[name]
        if spec is None:
            results[name] = {"status": "not planted: the function is not in the code yet"}
            print(f"{name}: not planted (not in the code yet)", flush=True)
            continue
        results[name] = run_plant(name, spec, args.timeout_s, args.keep)
    for name, result in results.items():
        result |= {
            "command": f"python bench/planted_noops.py --plants {name}",
            "machine": f"CPU ({os.cpu_count()} cores, shared), {platform.machine()}",
            "date": datetime.date.today().isoformat(),
        }
    # a run of some plants keeps the others' results in the file (one plant at a time: each takes minutes)
    earlier = json.loads(args.json.read_text())["plants"] if args.json.exists() else {}
    write_result(args.json, {"plants": {name: results.get(name, earlier.get(name)) for name in PLANTS}})
    missed = [name for name, result in results.items() if result["status"] == "missed"]
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
