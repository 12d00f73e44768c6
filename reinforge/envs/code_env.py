"""The code environment: runs the response's program against the record's tests in the sandbox.

Extraction (`extract_code`): the last ```python (or ```py, ```python3) fenced block of the last
assistant message, else its last fenced block of any language, else the whole message. A final
fence left open (generation stopped before the closing ```) counts as a block running to the end.
An empty program scores 0 without a run and counts in `no_code`.

Record formats, told apart by their keys (`DataError` for a record that has none of them, raised
before any sample of the batch runs):

- HumanEval: `test` defines `check(candidate)`, `entry_point` names the function, `prompt` holds its
  signature and docstring (and sometimes helpers, e.g. `poly` for `find_zero`, or imports). The
  prompt always runs first, so a response may define the whole function (the prompt's stub and
  helpers are then defined before it, and its definition wins), or give only the body, as a
  completion model would: when the program does not define `entry_point` at its top level, it is
  appended to the prompt and runs as one piece (HumanEval's own harness: prompt + completion). The
  test's code runs in a copy of the program's namespace (as in HumanEval's harness it sees the
  prompt's helpers, but its `check` cannot replace a helper of the program's), with `candidate`
  bound to the entry point. Each top-level statement of `check`'s body that contains an `assert`
  and uses `candidate` is one test; the others (imports, `rng = ...`) run in order as setup.
- MBPP: `test_list` is a list of assert statements, with optional `test_imports` (statements run
  before the program) and `test_setup_code` (run after it); every test is one assert.
- generic: `tests`, a list of assert statements, with the same optional keys as MBPP.

The program runs in a namespace of its own with `__name__ == "__solution__"`, so a response's
`if __name__ == "__main__":` demo does not run (as in HumanEval's and MBPP's harnesses).

One sandbox run per sample executes a harness: the program, then each setup step and test in its
own `try`, writing one result line per step as it finishes. The lines go to a duplicate of stdout
and start with a random nonce the harness reads from stdin, so whatever the program prints (or
whatever stdin it expects) cannot be mistaken for a result, and the results of the tests that ran
before a timeout still count. A program that fails to load fails every test. This guards against
accidents, not against a program written to forge results: it runs in the harness's interpreter.

A run the sandbox itself failed (status `error`: the supervisor crashed, could not start, was killed
from outside, or the program died while the host's out-of-memory killer ran) is no verdict on the
program: the response has `infra_failure="sandbox"` and no reward (the rollout retries it,
docs/environments.md). A program that crashes by itself (a nonzero exit, an uncaught exception, a
signal it sent itself, a timeout or a memory limit of its own) is the answer's failure and scores as
below.

Reward: 1.0 when the program loads, every setup step succeeds, every test passes and the run ends
normally (status ok: a program that passes and then hangs or floods its output fails), else 0; with
`partial_credit`, the fraction of tests that passed, whatever happened after them (setup failures
count through the tests they break). `components = {"pass_fraction": passed / total}`; `info` holds `status` (the
sandbox's: ok, failed, timeout, killed, output_limit, memory_limit, error; or no_code), `passed`, `total`, and
`error`, the first failure's exception (or the sandbox's stderr tail when no step reported one).

Metrics (since the last `metrics()` call): `samples`, `no_code`, `timeouts` (wall or CPU limit),
`output_limits`, `memory_limits` (killed in the run's own memory cgroup), `sandbox_errors` (the sandbox
itself failed to run the program: infrastructure failures), `pass_fraction_mean` (mean of passed / total
over samples, no-code ones included as 0) and `run_s_mean` (mean sandbox wall time per run).

Samples run concurrently on `num_parallel` threads, each driving one sandbox (a few processes);
`step` may be called from several threads.
"""

from __future__ import annotations

import ast
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.envs.sandbox import SandboxLimits, SandboxResult, check_sandbox_available, run_python
from reinforge.errors import DataError

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}
_MAX_ERROR_CHARS = 300


class CodeEnvConfig(Section):
    sandbox: SandboxLimits = SandboxLimits()
    """Limits and isolation of each run (one run per sample executes all of its tests)."""
    partial_credit: bool = False
    """false: reward 1 when every test passes, else 0; true: the fraction of tests that pass."""
    num_parallel: int = 4
    """Samples run at once, each in its own sandbox (threads of this process drive them)."""

    @model_validator(mode="after")
    def _check(self) -> "CodeEnvConfig":
        if self.num_parallel < 1:
            raise ValueError(f"env.code.num_parallel must be >= 1, got {self.num_parallel}")
        return self


@dataclass
class _Plan:
    """What one sample's run executes, in order: (kind, source) with kind program, setup or test."""

    steps: list[tuple[str, str]]
    entry_point: str | None  # HumanEval: tests run in a copy of the namespace, `candidate` bound to it

    @property
    def num_tests(self) -> int:
        return sum(kind == "test" for kind, _ in self.steps)


def extract_code(text: str) -> str:
    """The last python fenced block, else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(text)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


class CodeEnv:
    """Scores programs by running the record's tests in the sandbox; see the module doc."""

    def __init__(self, config: CodeEnvConfig) -> None:
        check_sandbox_available(config.sandbox, "env.code.sandbox")  # on this node too (an env worker's)
        self.config = config
        self._pool = ThreadPoolExecutor(config.num_parallel, thread_name_prefix="code-env")
        self._lock = threading.Lock()
        self._reset_counts()

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        records = [request.record for request in requests]
        programs = [extract_code(_response_text(request.messages)) for request in requests]
        plans = [_plan(record, program) for record, program in zip(records, programs)]  # DataError before any run
        return list(self._pool.map(self._score, plans, programs))

    def _score(self, plan: _Plan, program: str) -> EnvResponse:
        total = plan.num_tests
        if not program.strip():
            self._count(status="no_code", fraction=0.0, run_s=None)
            return EnvResponse(
                reward=0.0,
                components={"pass_fraction": 0.0},
                info={"status": "no_code", "passed": 0, "total": total, "error": "no code"},
            )
        nonce = secrets.token_hex(16)
        try:
            result = run_python(_harness(plan), self.config.sandbox, stdin=nonce + "\n")
        except OSError as exc:  # the sandbox could not even start (no process, no pipe left)
            result = SandboxResult("error", None, "", f"sandbox error: {exc!r}", 0.0)
        if result.status == "error":  # the sandbox's failure, not the program's: no verdict on the answer
            self._count(status="error", fraction=0.0, run_s=result.wall_s)
            tail = result.stderr.strip().splitlines()
            return EnvResponse(
                reward=0.0,
                info={
                    "status": "error",
                    "passed": 0,
                    "total": total,
                    "infra_error": f"sandbox: {tail[-1][:_MAX_ERROR_CHARS] if tail else 'no output'}",
                },
                infra_failure="sandbox",
            )
        passed, all_ok, error = _tally(plan, result, nonce)
        fraction = passed / total
        self._count(status=result.status, fraction=fraction, run_s=result.wall_s)
        reward = fraction if self.config.partial_credit else float(all_ok)
        return EnvResponse(
            reward=reward,
            components={"pass_fraction": fraction},
            info={"status": result.status, "passed": passed, "total": total, "error": error},
        )

    def _reset_counts(self) -> None:
        names = ["samples", "no_code", "timeouts", "output_limits", "memory_limits", "sandbox_errors"]
        self._counts = dict.fromkeys(names, 0)
        self._fraction_sum = 0.0
        self._run_s = []

    def _count(self, status: str, fraction: float, run_s: float | None) -> None:
        key = {
            "no_code": "no_code",
            "timeout": "timeouts",
            "output_limit": "output_limits",
            "memory_limit": "memory_limits",
            "error": "sandbox_errors",
        }.get(status)
        with self._lock:
            self._counts["samples"] += 1
            if key:
                self._counts[key] += 1
            self._fraction_sum += fraction
            if run_s is not None:
                self._run_s.append(run_s)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            metrics = {name: float(count) for name, count in self._counts.items()}
            samples = self._counts["samples"]
            metrics["pass_fraction_mean"] = self._fraction_sum / samples if samples else 0.0
            metrics["run_s_mean"] = sum(self._run_s) / len(self._run_s) if self._run_s else 0.0
            self._reset_counts()
        return metrics

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "CodeEnv":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _response_text(messages: list[dict[str, str]]) -> str:
    """The content of the last assistant message (of the last message if none has that role)."""
    assistant = [message for message in messages if message.get("role") == "assistant"] or messages[-1:]
    return (assistant[-1].get("content") or "") if assistant else ""


def _plan(record: dict[str, Any], program: str) -> _Plan:
    if "test" in record and "entry_point" in record:
        return _humaneval_plan(record, program)
    for key in ("test_list", "tests"):
        if key in record:
            return _assert_plan(record, key, program)
    raise DataError(
        f"CodeEnv needs tests in each record: `test` + `entry_point` (HumanEval), `test_list` (MBPP) or "
        f"`tests` (a list of assert statements); got keys {sorted(record)}"
    )


def _humaneval_plan(record: dict[str, Any], program: str) -> _Plan:
    entry_point, test = record["entry_point"], record["test"]
    try:
        module = ast.parse(test)
    except SyntaxError as exc:
        raise DataError(f"record {record.get('task_id', '?')}: its `test` is not valid Python: {exc}") from None
    checks = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if not checks:
        raise DataError(f"record {record.get('task_id', '?')}: its `test` does not define check(candidate)")
    prompt = record.get("prompt", "")
    if _defines(program, entry_point):
        steps = [("program", prompt), ("program", program)]
    else:  # a body to complete the prompt's stub with
        steps = [("program", prompt + program)]
    steps.append(("setup", test))
    for statement in checks[-1].body:
        kind = "test" if _is_test(statement) else "setup"
        steps.append((kind, ast.unparse(statement)))
    plan = _Plan(steps=steps, entry_point=entry_point)
    if not plan.num_tests:
        raise DataError(f"record {record.get('task_id', '?')}: its check(candidate) has no assert that uses candidate")
    return plan


def _assert_plan(record: dict[str, Any], key: str, program: str) -> _Plan:
    tests = record[key]
    if not isinstance(tests, list) or not tests or not all(isinstance(test, str) for test in tests):
        raise DataError(f"record {record.get('task_id', '?')}: `{key}` must be a non-empty list of assert statements")
    steps = [("setup", line) for line in record.get("test_imports") or []]
    steps.append(("program", program))
    if record.get("test_setup_code"):
        steps.append(("setup", record["test_setup_code"]))
    steps.extend(("test", test) for test in tests)
    return _Plan(steps=steps, entry_point=None)


def _defines(program: str, name: str) -> bool:
    """Whether `program` parses and binds `name` at its top level (def, class, assignment or import)."""
    try:
        module = ast.parse(program)
    except SyntaxError:
        return False
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (alias.asname or alias.name) == name for alias in node.names
        ):
            return True
    return False


def _is_test(statement: ast.stmt) -> bool:
    nodes = list(ast.walk(statement))
    return any(isinstance(node, ast.Assert) for node in nodes) and any(
        isinstance(node, ast.Name) and node.id == "candidate" for node in nodes
    )


_HARNESS = """\
import os as _os, sys as _sys
_nonce = _sys.stdin.readline().strip()
_results = _os.dup(1)
_steps = {steps!r}
_entry_point = {entry_point!r}


def _report(index, ok, error=""):
    line = repr((index, ok, error[:{max_error}]))  # repr, not json: importing json costs every run ~9 ms
    _os.write(_results, ("\\n" + _nonce + line + "\\n").encode())


def _describe(exc):
    try:
        return type(exc).__name__ + ": " + str(exc)
    except BaseException:
        return type(exc).__name__


def _run():
    program = {{"__name__": "__solution__", "__builtins__": __builtins__}}
    tests = None if _entry_point else program
    for index, (kind, source) in enumerate(_steps):
        if kind != "program" and tests is None:
            if _entry_point not in program:
                _report(index, False, "NameError: the program does not define " + _entry_point)
                return
            tests = dict(program, candidate=program[_entry_point])
        try:
            exec(compile(source, "<" + kind + ">", "exec"), program if kind == "program" else tests)
        except BaseException as exc:
            _report(index, False, _describe(exc))
            if kind == "program":
                return
        else:
            _report(index, True)


_run()
"""


def _harness(plan: _Plan) -> str:
    return _HARNESS.format(steps=plan.steps, entry_point=plan.entry_point, max_error=_MAX_ERROR_CHARS)


def _tally(plan: _Plan, result: SandboxResult, nonce: str) -> tuple[int, bool, str]:
    """(tests passed, whether everything passed, the first error) from the harness's result lines."""
    reports: dict[int, tuple[bool, str]] = {}
    for line in re.findall(re.escape(nonce) + r"(.*)", result.stdout):
        try:
            index, ok, error = ast.literal_eval(line)
        except (ValueError, TypeError, SyntaxError):
            continue  # a line cut off by a kill
        reports.setdefault(int(index), (bool(ok), str(error)))
    passed = sum(reports.get(index, (False, ""))[0] for index, (kind, _) in enumerate(plan.steps) if kind == "test")
    all_ok = all(reports.get(index, (False, ""))[0] for index in range(len(plan.steps)))
    errors = [error for ok, error in (reports[index] for index in sorted(reports)) if not ok]
    if errors:
        error = errors[0]
    elif all_ok:
        error = ""
    else:  # the run ended before every step reported
        tail = result.stderr.strip().splitlines()
        error = f"{result.status}: {tail[-1][:_MAX_ERROR_CHARS] if tail else 'no output'}"
    return passed, all_ok and result.status == "ok", error
