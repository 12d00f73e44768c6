import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from reinforge.envs.base import EnvRequest
from reinforge.envs.math_env import MathEnv, _verdict, extract_answer, extract_choice
from reinforge.errors import ConfigError, DataError

DATA = Path(__file__).resolve().parents[1] / "data"
# 9^(9^9) has about 370 million digits: math-verify was still busy on it after 20 s (measured).
PATHOLOGICAL = "\\boxed{9^{9^{9}}}"
# MATH-500 records (by unique_id) whose own solution math-verify 0.9.0 does not accept: none so far.
MATH500_EXCEPTIONS: set[str] = set()


def request(response: str, answer) -> EnvRequest:
    return EnvRequest(
        messages=[
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": response},
        ],
        record={"answer": answer},
    )


def rewards(env: MathEnv, cases: list[tuple[str, object]]) -> list[float]:
    return [response.reward for response in env.step([request(r, a) for r, a in cases])]


@pytest.fixture(scope="module")
def env():
    env = MathEnv(timeout_s=5.0)
    yield env
    env.close()


def test_the_last_boxed_answer_wins():
    assert extract_answer("first \\boxed{1}, then \\fbox{2}, finally \\boxed{3}.") == "3"


def test_boxed_answers_keep_nested_and_escaped_braces():
    assert extract_answer("$\\boxed{\\frac{1}{\\sqrt{2}}}$") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"


def test_a_box_cut_off_by_the_length_limit_is_skipped():
    assert extract_answer("\\boxed{4} so far, but then \\boxed{\\frac{1}{2") == "4"


def test_without_a_box_the_last_number_is_the_answer():
    assert extract_answer("She has 3 apples and buys 1,234 more: 1,237.") == "1237"
    assert extract_answer("x = -2.5 and y = 3/4") == "3/4"
    assert extract_answer("the temperature drops to -7") == "-7"
    assert extract_answer("pages 3-5") == "5"  # after a number, "-" subtracts
    assert extract_answer("so we take 8 - 3") == "3"
    assert extract_answer("so x = -3") == "-3"
    assert extract_answer("no digits here") is None


def test_equivalent_forms_score_one(env):
    cases = [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("so the answer is \\boxed{56}.", "56"),
        ("\\boxed{56}", 56),
        ("In total 1,234 apples.", 1234),
        ("\\boxed{1,234}", "1234"),
        ("\\boxed{3}", "$x=3$"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
        ("\\boxed{025}", 25),
    ]
    assert rewards(env, cases) == [1.0] * len(cases)
    assert env.metrics() == {"verifier_errors": 0.0, "verifier_timeouts": 0.0, "verifier_deaths": 0.0, "no_answer": 0.0}


def test_wrong_and_missing_answers_score_zero_and_missing_ones_are_counted(env):
    responses = env.step(
        [
            request("\\boxed{57}", "56"),
            request("\\boxed{\\frac{1}{3}}", "0.5"),
            request("I cannot solve this.", "56"),
        ]
    )
    assert [r.reward for r in responses] == [0.0, 0.0, 0.0]
    assert [r.info["extracted"] for r in responses] == ["57", "\\frac{1}{3}", None]
    assert env.metrics() == {"verifier_errors": 0.0, "verifier_timeouts": 0.0, "verifier_deaths": 0.0, "no_answer": 1.0}


def test_metrics_reset_after_each_call(env):
    env.step([request("nothing", "1")])
    assert env.metrics()["no_answer"] == 1.0
    assert env.metrics()["no_answer"] == 0.0


@pytest.mark.parametrize(
    "gold, answer",
    [("56", "56"), ("56", "57"), ("025", "25"), ("-0", "0"), ("-3", "3"), ("1" * 30, "1" * 31)],
)
def test_integer_fast_path_agrees_with_math_verify(env, gold, answer):
    math_verify_says = _verdict(f"\\boxed{{{gold}}}", f"\\boxed{{{answer}}}") == "1"
    assert rewards(env, [(f"\\boxed{{{answer}}}", gold)]) == [float(math_verify_says)]


def slow_batch_is_cut_off(env: MathEnv) -> tuple[list[float], float]:
    """Scores [pathological, 1/2 == 0.5] and returns the rewards and the seconds it took."""
    start = time.monotonic()
    scores = rewards(env, [(PATHOLOGICAL, "1"), ("\\boxed{\\frac{1}{2}}", "0.5")])
    return scores, time.monotonic() - start


def test_a_pathological_answer_times_out_scores_zero_and_the_rest_of_the_batch_is_scored():
    """Timeout 1 s plus a worker restart (about 1 s) for the next sample; 15 s leaves CI slack."""
    env = MathEnv(timeout_s=1.0)
    try:
        scores, seconds = slow_batch_is_cut_off(env)
        assert scores == [0.0, 1.0]
        assert seconds < 15
        assert env.metrics() == {
            "verifier_errors": 0.0,
            "verifier_timeouts": 1.0,
            "verifier_deaths": 0.0,
            "no_answer": 0.0,
        }
    finally:
        env.close()


def test_timeouts_also_work_when_step_runs_outside_the_main_thread():
    """math-verify's own signal.alarm timeout would raise ValueError in this thread."""
    env = MathEnv(timeout_s=1.0)
    results = {}
    thread = threading.Thread(target=lambda: results.update(out=slow_batch_is_cut_off(env)))
    try:
        thread.start()
        thread.join(timeout=30)
        scores, seconds = results["out"]
        assert scores == [0.0, 1.0]
        assert seconds < 15
        assert env.metrics()["verifier_timeouts"] == 1.0
    finally:
        env.close()


def test_repeated_answers_in_a_batch_are_verified_once(env, monkeypatch):
    """A group of 4 with answers [1/2, 1/2, 1/3, 1/2] needs 2 verifications, not 4: a repeated
    pathological answer would otherwise cost one timeout per copy."""
    sent = []
    verdicts = env._worker.verdicts

    def recording_verdicts(pairs, timeout_s):
        sent.extend(pairs)
        return verdicts(pairs, timeout_s)

    monkeypatch.setattr(env._worker, "verdicts", recording_verdicts)
    answers = ["\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{3}", "\\frac{1}{2}"]
    assert rewards(env, [(f"\\boxed{{{a}}}", "0.5") for a in answers]) == [1.0, 1.0, 0.0, 1.0]
    assert sent == [
        ("\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"),
        ("\\boxed{0.5}", "\\boxed{\\frac{1}{3}}"),
    ]


def test_multiple_choice_letters_come_from_boxes_or_answer_phrases():
    assert extract_choice("A is wrong, B too, so \\boxed{C}") == "C"
    assert extract_choice("\\boxed{(D)}") == "D"
    assert extract_choice("\\boxed{\\text{E}}") == "E"
    assert extract_choice("Thus the answer is (B).") == "B"
    assert extract_choice("Answer: J") == "J"
    assert extract_choice("**Answer:** C") == "C"
    assert extract_choice("The answer is a number.") is None  # lower-case "a" is a word
    assert extract_choice("I think it is C") is None


def test_multiple_choice_mode_compares_letters():
    env = MathEnv(mode="multiple_choice")
    cases = [("\\boxed{C}", "C"), ("The answer is (B).", "(b)"), ("Answer: A", "B"), ("?", "A")]
    assert rewards(env, cases) == [1.0, 1.0, 0.0, 0.0]
    assert env.metrics() == {"verifier_errors": 0.0, "verifier_timeouts": 0.0, "verifier_deaths": 0.0, "no_answer": 1.0}
    with pytest.raises(DataError, match="A-J"):
        env.step([request("\\boxed{C}", "42")])
    env.close()


def test_bad_settings_are_user_errors():
    with pytest.raises(ConfigError, match="mode"):
        MathEnv(mode="maths")
    with pytest.raises(ConfigError, match="timeout_s"):
        MathEnv(timeout_s=0)


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_gsm8k_solutions_score_one_boxed_or_not(env):
    """The first 100 GSM8K test records: the worked solution with its "#### N" line replaced by
    "The answer is \\boxed{N}." scores 1, and so does the raw solution (N is its last number)."""
    records = read_jsonl("gsm8k_test_first100.jsonl")
    golds = [record["answer"].split("#### ")[-1] for record in records]
    boxed = [
        (record["answer"].split("#### ")[0] + f"The answer is \\boxed{{{gold}}}.", gold)
        for record, gold in zip(records, golds)
    ]
    raw = [(record["answer"], gold) for record, gold in zip(records, golds)]
    assert rewards(env, boxed) == [1.0] * 100
    assert rewards(env, raw) == [1.0] * 100


def test_gsm8k_published_answers_are_golds_as_they_are(env):
    """GSM8K's `answer` column as published (the worked solution, then "#### N"), used as the gold with no
    conversion (data.columns.answer=answer): "\\boxed{N}" scores 1, another number 0."""
    records = read_jsonl("gsm8k_test_first100.jsonl")[:20]
    finals = [record["answer"].split("#### ")[-1].replace(",", "") for record in records]
    assert rewards(env, [(f"\\boxed{{{n}}}", r["answer"]) for r, n in zip(records, finals)]) == [1.0] * 20
    assert rewards(env, [(f"\\boxed{{{int(n) + 1}}}", r["answer"]) for r, n in zip(records, finals)]) == [0.0] * 20


def test_math500_solutions_score_one_against_their_answers(env):
    """The first 100 MATH-500 test records: each worked solution ends in a boxed answer that
    math-verify must accept against the record's `answer` field (at least 99%)."""
    records = read_jsonl("math500_test_first100.jsonl")
    scores = rewards(env, [(record["solution"], record["answer"]) for record in records])
    failures = {record["unique_id"] for record, score in zip(records, scores) if score != 1.0}
    assert failures == MATH500_EXCEPTIONS
    assert sum(scores) >= 99
    assert env.metrics() == {"verifier_errors": 0.0, "verifier_timeouts": 0.0, "verifier_deaths": 0.0, "no_answer": 0.0}


# A verifier process that dies is no verdict on any answer: infrastructure, never a reward of 0.


def test_a_worker_killed_between_steps_is_replaced_and_every_sample_is_scored_for_real():
    env = MathEnv(timeout_s=10.0)
    try:
        assert rewards(env, [("\\boxed{\\frac{1}{2}}", "0.5")]) == [1.0]
        os.kill(env._worker.pid, signal.SIGKILL)  # the out-of-memory killer's choice, while it is idle
        responses = env.step([request("\\boxed{\\frac{1}{2}}", "0.5"), request("\\boxed{\\frac{1}{3}}", "0.5")])
        assert [(r.reward, r.infra_failure) for r in responses] == [(1.0, None), (0.0, None)]
        assert env.metrics()["verifier_deaths"] == 1.0
    finally:
        env.close()


def test_a_worker_killed_while_verifying_and_again_on_retry_leaves_that_sample_unscored_and_scores_the_rest():
    """The first worker is killed 1 s into the pathological answer, its replacement 0.5 s after it starts: that
    answer has no verdict (infrastructure: retried and masked by the rollout, not 0); a third worker scores the rest."""
    env = MathEnv(timeout_s=20.0)
    assert rewards(env, [("\\boxed{\\frac{1}{2}}", "0.5")]) == [1.0]  # the first worker is ready
    env.metrics()
    killed = []

    def kill_twice():
        time.sleep(1.0)
        while len(killed) < 2:
            pid = env._worker.pid
            if pid is not None and pid not in killed:
                if killed:
                    time.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_twice, daemon=True)
    try:
        killer.start()
        start = time.monotonic()
        died, scored = env.step([request(PATHOLOGICAL, "1"), request("\\boxed{\\frac{1}{2}}", "0.5")])
        seconds = time.monotonic() - start
        assert len(killed) == 2 and seconds < 15  # never the 20 s of a timeout
        assert died.infra_failure == "verifier"
        assert "math-verify worker process died (ended by signal 9)" in died.info["infra_error"]
        assert (scored.reward, scored.infra_failure) == (1.0, None)
        metrics = env.metrics()
        assert (metrics["verifier_deaths"], metrics["verifier_timeouts"], metrics["verifier_errors"]) == (2.0, 0.0, 0.0)
    finally:
        killer.join(timeout=5)
        env.close()


def test_a_worker_that_cannot_import_math_verify_is_a_one_line_error_not_an_infra_failure(tmp_path, monkeypatch):
    """An installation without math-verify would fail the same way on every restart: the user's to fix."""
    from reinforge.errors import ReinforgeError

    (tmp_path / "math_verify").mkdir()
    (tmp_path / "math_verify" / "__init__.py").write_text("raise ImportError('math-verify is not installed')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker's math_verify is this broken one
    env = MathEnv(timeout_s=5.0)
    try:
        with pytest.raises(ReinforgeError, match=r"worker exited with status 1 before it was ready.*pip install") as e:
            env.step([request("\\boxed{\\frac{1}{2}}", "0.5")])
        assert "\n" not in str(e.value)
    finally:
        env.close()
