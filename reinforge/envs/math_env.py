"""The math environment: reward 1 when the response's final answer equals the record's answer.

Extraction (`extract_answer`): the content of the last complete `\\boxed{...}` or `\\fbox{...}`
(nested braces allowed), else the last number in the text (`-3`, `2.5`, `3/4`, `1,234` -> `1234`),
else None. In `mode="multiple_choice"` the answer is a letter A-J from `\\boxed{C}`,
"the answer is (C)" or "Answer: C", compared with `record["answer"]` as a string.

Verification: HF math-verify (`parse` then `verify`) compares the extracted answer with
`record["answer"]`. Both are wrapped in `\\boxed{}` before parsing, because math-verify's LaTeX
extractor needs delimiters: a bare "56", "\\frac{1}{2}", "x=3" or "1,234" then parse whole (a bare
`\\text{Evelyn}` without delimiters parses to nothing). When both sides are plain integers the
comparison is `int(a) == int(b)` in the calling process: math-verify parses such strings to sympy
Integers and compares them exactly, so the verdict is the same (a test holds this), and GSM8K-style
batches never pay for the verifier.

Timeouts: math-verify's own timeout is `signal.alarm`, which only works in the main thread
(elsewhere it raises ValueError: Ray actor threads, HTTP handlers), counts whole seconds, and
replaces the host's SIGALRM handler. So every comparison that is not two plain integers runs in one
persistent worker process (started with `python -c`, so it never re-imports the caller's
`__main__`), with math-verify's signal timeouts switched off. The caller sends it a batch, reads
one verdict per sample and waits for each with `select` for at most `timeout_s`. When a verdict is
late the caller kills the worker (SIGKILL stops it even inside a long C call, which no in-process
timeout can), scores that sample 0, counts a timeout, starts a fresh worker and sends it the rest
of the batch. The time limit is the answer's: an answer math-verify cannot settle within it (9^(9^9)
written out) is the policy's doing, like a program past its own time limit in the code environment.
The same code path runs in every thread; a lock serialises concurrent `step` calls on
one env, so use one env per thread to verify in parallel. Identical (gold, answer) pairs in a batch
are verified once, so a GRPO group that repeats a pathological answer pays one timeout (and the
counters still count samples). A sample on which math-verify raises scores 0 and counts as a
verifier error, unless another (gold, prediction) parse pair matches, as in math-verify's `verify`.

A worker that dies (killed from outside, e.g. by the out-of-memory killer, or crashed) is no verdict on
any answer: the sample it was verifying is sent again to a fresh worker, once; if that one dies on it
too, or the worker died `_MAX_DEATHS` times in one batch, or a fresh one does not start within
`_STARTUP_TIMEOUT_S`, the samples left have no verdict: infrastructure failures (`infra_failure=
"verifier"`), which the rollout runs again and then masks (rollout/infra.py), never a reward of 0.
`verifier_deaths` counts the deaths. A worker that exits with an error before it is ready (math-verify
not installed) is a one-line error: that is the installation's, and would repeat.

Cost per sample on one CPU core: plain integers 0.01 ms (in the caller); through the worker, an
integer 1.6 ms (1.4 ms of it is math-verify), a MATH-500 answer 3.3 ms; a timeout costs `timeout_s`
plus about 1 s to restart the worker.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from reinforge.config.section import Section
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.errors import ConfigError, DataError, ReinforgeError


class MathEnvConfig(Section):
    timeout_s: float = 5.0
    """Per-sample verification time limit; a timeout is the answer's (math-verify could not settle it): it scores 0
    and is counted. A verifier process that dies is no verdict: an infrastructure failure, retried, then masked."""


_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(
    r"(?:(?<![\d)])(?<![\d)] )-)?"  # a minus sign, not a subtraction: "3-5", "3 - 5" end in 5
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # thousands separated by commas: 1,234.5
    r"|\d+/\d+"  # a fraction: 3/4
    r"|\d*\.\d+"  # a decimal: 2.5, .5
    r"|\d+)"  # an integer
)
_INTEGER = re.compile(r"-?\d+")
_CHOICE_IN_BOX = re.compile(r"\s*(?:\\text(?:bf)?\{)?\s*\(?([A-J])\)?(?![A-Za-z])")
_CHOICE_IN_TEXT = re.compile(r"(?i:answer)(?:\s+is|\s*:)[\s*]*(?:\(([A-J])\)|([A-J])(?![A-Za-z]))")

_CORRECT, _WRONG, _ERROR = "1", "0", "E"  # verdict lines sent by the worker
_TIMEOUT, _DIED = "T", "D"  # no verdict line: late (the answer's), or the worker died (infrastructure)
_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine; not a per-sample budget
_MAX_DEATHS = 3  # worker deaths in one batch after which its samples left are infrastructure failures


def _boxed_contents(text: str) -> list[str]:
    """The contents of every complete `\\boxed{...}`/`\\fbox{...}` in `text`, in order."""
    contents = []
    for start in _BOX_START.finditer(text):
        depth, i = 1, start.end()
        while i < len(text) and depth:
            if text[i] == "\\":  # `\{` and `\}` are literal braces, not grouping
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:  # a box cut off by the length limit holds no answer
            contents.append(text[start.end() : i - 1].strip())
    return contents


def extract_answer(text: str) -> str | None:
    """The last boxed answer in `text`, else its last number (commas dropped), else None."""
    boxes = _boxed_contents(text)
    if boxes:
        return boxes[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_choice(text: str) -> str | None:
    """The last multiple-choice letter A-J: from a box, else from "answer is (C)"/"Answer: C"."""
    for box in reversed(_boxed_contents(text)):
        match = _CHOICE_IN_BOX.match(box)
        if match:
            return match.group(1)
    matches = _CHOICE_IN_TEXT.findall(text)
    return (matches[-1][0] or matches[-1][1]) if matches else None


def _verdict(gold_latex: str, pred_latex: str) -> str:
    """math-verify's verdict on one pair, run in the worker: correct, wrong or error."""
    from math_verify import parse, verify

    try:
        gold = parse(gold_latex, parsing_timeout=None, raise_on_error=True)
        pred = parse(pred_latex, parsing_timeout=None, raise_on_error=True)
    except Exception:
        return _ERROR
    # verify(gold, pred) is any() over these pairs and hides errors; one pair at a time counts them.
    raised = False
    for gold_item, pred_item in itertools.product(gold, pred):
        try:
            if verify(gold_item, pred_item, timeout_seconds=None, raise_on_error=True):
                return _CORRECT
        except Exception:
            raised = True
    return _ERROR if raised else _WRONG


def _serve() -> None:
    """The worker's main loop: read a JSON list of [gold, prediction] pairs per line, write one
    verdict line per pair."""
    import logging

    # The caller enforces the time limit, so math-verify's "timeout is disabled" warning is noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Keep stdout for verdicts only: anything a library prints goes to stderr instead.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _verdict("\\boxed{1}", "\\boxed{1}")  # load the LaTeX grammar before declaring ready
    protocol.write("ready\n")
    protocol.flush()
    for line in sys.stdin:
        for gold, pred in json.loads(line):
            protocol.write(_verdict(gold, pred) + "\n")
            protocol.flush()


class _NotStarted(Exception):
    """A fresh worker that died or stayed silent before it was ready: a death like any other."""


class _Worker:
    """The verifier process, replaced whenever it overruns a sample's time or dies."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._buffer = b""  # bytes read from the worker but not yet split into lines
        self._ready = False  # the worker has imported math-verify and said so
        self.deaths = 0  # since the last `take_deaths`
        self.last_death = ""  # what the last death looked like, for the infrastructure failure's line

    def start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from reinforge.envs.math_env import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": pythonpath},
        )
        self._buffer = b""
        self._ready = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> int | None:
        """Kill the worker; its exit status (negative: the signal that ended it), None if none was running."""
        if self._proc is None:
            return None
        self._proc.kill()
        code = self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):  # a write that failed may still be buffered
                pipe.close()
        self._proc = None
        return code

    def verdicts(self, pairs: list[tuple[str, str]], timeout_s: float) -> list[str]:
        """One verdict per (gold, prediction) pair: `_TIMEOUT` for those slower than `timeout_s`, `_DIED` for those
        left without a verdict by the worker's deaths (module doc)."""
        verdicts: list[str] = []
        deaths_on_this_pair = deaths = 0
        while len(verdicts) < len(pairs):
            try:
                self._send(pairs[len(verdicts) :])
                line = self._read_line(timeout_s)
                while line in (_CORRECT, _WRONG, _ERROR):
                    verdicts.append(line)
                    deaths_on_this_pair = 0
                    line = self._read_line(timeout_s) if len(verdicts) < len(pairs) else None
                if len(verdicts) == len(pairs):
                    break
            except _NotStarted as exc:
                line = str(exc)
            if line is None:  # late: the answer's; kill it, the next round restarts after this sample
                self.close()
                verdicts.append(_TIMEOUT)
                deaths_on_this_pair = 0
                continue
            self._died(line)
            deaths += 1
            deaths_on_this_pair += 1
            if deaths >= _MAX_DEATHS:
                return verdicts + [_DIED] * (len(pairs) - len(verdicts))
            if deaths_on_this_pair == 2:  # it died on this sample twice: no verdict for it, go on without it
                verdicts.append(_DIED)
                deaths_on_this_pair = 0
        return verdicts

    def _died(self, seen: str) -> None:
        code = self.close()
        self.deaths += 1
        how = f"ended by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        self.last_death = f"the math-verify worker process died ({seen or how}) while verifying"

    def _send(self, pairs: list[tuple[str, str]]) -> None:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:  # it died between batches (killed while idle): no sample lost
                self._died("")
            self.start()
        if not self._ready:
            line = self._read_line(_STARTUP_TIMEOUT_S)
            if line != "ready":
                code = None
                if line == "":  # it closed its output: it is exiting
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        code = self._proc.wait(timeout=5)
                if code is not None and code > 0:  # it raised on start-up: the installation's, and it would repeat
                    self.close()
                    raise ReinforgeError(
                        f"the math-verify worker exited with status {code} before it was ready (its error is on "
                        "stderr above); is math-verify installed (pip install math-verify)?"
                    )
                raise _NotStarted(f"it did not start within {_STARTUP_TIMEOUT_S:g} s" if line is None else "")
            self._ready = True
        try:
            self._proc.stdin.write(json.dumps(pairs).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died since the check above; the read sees end-of-file and restarts it

    def _read_line(self, timeout_s: float) -> str | None:
        """The worker's next line; None if none came within `timeout_s`, "" if it died."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return ""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


class MathEnv:
    """Scores final answers with math-verify, or multiple-choice letters; see the module doc."""

    def __init__(self, timeout_s: float = 5.0, mode: str = "math") -> None:
        if mode not in ("math", "multiple_choice"):
            raise ConfigError(f"MathEnv mode must be 'math' or 'multiple_choice', got {mode!r}")
        if timeout_s <= 0:
            raise ConfigError(f"MathEnv timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.mode = mode
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(["verifier_errors", "verifier_timeouts", "verifier_deaths", "no_answer"], 0)
        self._worker = _Worker()
        if mode == "math":
            self._worker.start()  # sympy imports while the policy generates
            weakref.finalize(self, self._worker.close)

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        golds = [_gold_answer(request.record) for request in requests]
        extract = extract_choice if self.mode == "multiple_choice" else extract_answer
        answers = [extract(request.messages[-1]["content"]) for request in requests]
        with self._lock:
            if self.mode == "multiple_choice":
                choices = [_gold_choice(gold) for gold in golds]
                verdicts = [_CORRECT if a == c else _WRONG for c, a in zip(choices, answers)]
            else:
                verdicts = self._verify(golds, answers)
            self._counts["no_answer"] += sum(answer is None for answer in answers)
            self._counts["verifier_errors"] += verdicts.count(_ERROR)
            self._counts["verifier_timeouts"] += verdicts.count(_TIMEOUT)
            self._counts["verifier_deaths"] += self._worker.deaths
            self._worker.deaths = 0
        return [
            EnvResponse(reward=float(verdict == _CORRECT), info={"extracted": answer})
            if verdict != _DIED
            else EnvResponse(
                reward=0.0,
                infra_failure="verifier",
                info={"extracted": answer, "infra_error": f"{self._worker.last_death} this answer"},
            )
            for verdict, answer in zip(verdicts, answers)
        ]

    def _verify(self, golds: list[str], answers: list[str | None]) -> list[str]:
        verdicts = [_WRONG] * len(golds)
        slow = []  # indices that need math-verify
        for i, (gold, answer) in enumerate(zip(golds, answers)):
            if answer is None:
                continue
            if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(answer):
                verdicts[i] = _CORRECT if int(gold) == int(answer) else _WRONG
            else:
                slow.append(i)
        pairs = [(f"\\boxed{{{golds[i]}}}", f"\\boxed{{{answers[i]}}}") for i in slow]
        # A GRPO group often repeats an answer: verify it once, and pay a timeout at most once.
        unique = list(dict.fromkeys(pairs))
        verdict_of = dict(zip(unique, self._worker.verdicts(unique, self.timeout_s)))
        for i, pair in zip(slow, pairs):
            verdicts[i] = verdict_of[pair]
        return verdicts

    def metrics(self) -> dict[str, float]:
        with self._lock:
            counts = {name: float(count) for name, count in self._counts.items()}
            self._counts = dict.fromkeys(self._counts, 0)
        return counts

    def close(self) -> None:
        with self._lock:
            self._worker.close()


def _gold_answer(record: dict) -> str:
    if "answer" not in record:
        raise DataError(f"MathEnv needs an 'answer' in each record; got keys {sorted(record)}")
    # Inline math delimiters around a gold ("$x=3$") would end up inside \boxed{}.
    return str(record["answer"]).strip().strip("$").strip()


def _gold_choice(gold: str) -> str:
    choice = gold.strip("()").upper()
    if not re.fullmatch(r"[A-J]", choice):
        raise DataError(f"multiple-choice answers must be a letter A-J, got {gold!r}")
    return choice
