"""The IFEval checks whose regular expressions reinforge rewrote for linear time: the same verdicts as IFEval's own
patterns on thousands of random texts, and linear time on the degenerate responses that take IFEval's minutes."""

import random
import re
import time

import pytest

from reinforge.envs.ifeval_checks import bind_instruction


def follows(instruction_id: str, response: str, **kwargs) -> bool:
    return bind_instruction(instruction_id, kwargs)(response)


def random_texts(alphabet: list[str], num_texts: int = 3000, max_length: int = 12) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choices(alphabet, k=rng.randint(0, max_length))) for _ in range(num_texts)]


def test_placeholder_counts_equal_ifevals_lazy_bracket_matches():
    for text in random_texts(["[", "]", "\n", "a", " "]):
        count = len(re.findall(r"\[.*?\]", text))  # IFEval's pattern
        assert follows("detectable_content:number_placeholders", text, num_placeholders=count), text
        assert not follows("detectable_content:number_placeholders", text, num_placeholders=count + 1), text


def test_bullet_counts_equal_ifevals_multiline_matches():
    for text in random_texts(["*", "-", "\n", " ", "a"]):
        count = len(re.findall(r"^\s*\*[^\*].*$", text, re.MULTILINE))  # IFEval's patterns
        count += len(re.findall(r"^\s*-.*$", text, re.MULTILINE))
        assert follows("detectable_format:number_bullet_lists", text, num_bullets=count), repr(text)


def test_title_verdicts_equal_ifevals_matches():
    for text in random_texts(["<", ">", "\n", " ", "a"]):
        expected = any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))
        assert follows("detectable_format:title", text) == expected, repr(text)


def test_postscript_verdicts_equal_ifevals_patterns():
    patterns = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}  # IFEval's
    for text in random_texts(["P", "p", ".", "s", "S", " ", "\n"]):
        for marker, pattern in patterns.items():
            expected = bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))
            assert follows("detectable_content:postscript", text, postscript_marker=marker) == expected, text


@pytest.mark.parametrize(
    "instruction_id, kwargs",
    [
        ("detectable_content:number_placeholders", {"num_placeholders": 1}),
        ("detectable_format:number_bullet_lists", {"num_bullets": 1}),
        ("detectable_format:title", {}),
        ("detectable_content:postscript", {"postscript_marker": "P.P.S"}),
        ("length_constraints:number_sentences", {"num_sentences": 1, "relation": "at least"}),
    ],
)
def test_checks_take_linear_time_on_degenerate_responses(instruction_id, kwargs):
    """200,000 repeated characters: IFEval's patterns take minutes on some of these."""
    check = bind_instruction(instruction_id, kwargs)
    start = time.perf_counter()
    for char in "[<\n .*-":
        check(char * 200_000)
    assert time.perf_counter() - start < 2.0
