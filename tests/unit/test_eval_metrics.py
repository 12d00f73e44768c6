"""pass@k, maj@k and mean accuracy against hand-computed values (reinforge/evaluation/metrics.py)."""

import math

import pytest

from reinforge.evaluation.metrics import maj_at_k, majority_vote, mean_accuracy, mean_pass_at_k, pass_at_k


def test_pass_at_k_of_five_samples_two_correct_draws_two():
    """n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; as the product, 1 - (1 - 2/4)(1 - 2/5) = 1 - 0.5 * 0.6."""
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)


def test_pass_at_k_of_ten_samples_three_correct_draws_five():
    """n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12."""
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12)


def test_pass_at_1_is_the_fraction_correct():
    """n=4, c=1, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 1/4 = c/n."""
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)


def test_pass_at_k_is_one_when_every_draw_of_k_holds_a_correct_sample():
    """n=4, c=2, k=3: only 2 wrong samples, so any 3 include a correct one (C(2,3) = 0)."""
    assert pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0


def test_pass_at_k_is_zero_without_a_correct_sample():
    assert pass_at_k(8, 0, 4) == 0.0


def test_pass_at_k_equals_the_binomial_formula_for_every_small_case():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_where_the_binomials_overflow_a_float():
    """C(2000, 1000) ~ 2e600 overflows a float; the product never forms it. n=2000, c=1, k=1000:
    1 - C(1999,1000)/C(2000,1000) = 1 - (2000-1000)/2000 = 0.5."""
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_mean_pass_at_k_averages_over_prompts():
    """Prompt 1: n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2. Prompt 2: n=4, c=2: 1 - C(2,2)/C(4,2)
    = 1 - 1/6 = 5/6. Mean: (1/2 + 5/6) / 2 = 2/3."""
    correct = [[True, False, False, False], [False, True, True, False]]
    assert mean_pass_at_k(correct, 2) == pytest.approx(2 / 3)


def test_majority_vote_ignores_whitespace_and_skips_missing_answers():
    """ "7" gets 3 votes (indices 1, 3, 4; " 7" is "7"), "12" gets 2: the winner's first sample is 1."""
    assert majority_vote(["12", "7", "1 2", "7", " 7", None]) == 1


def test_majority_vote_breaks_ties_by_the_answer_seen_first():
    """ "5" and "3" have 2 votes each; "5" appears first (index 0)."""
    assert majority_vote(["5", "3", "3", "5"]) == 0
    assert majority_vote(["3", "5", "5", "3"]) == 0


def test_majority_vote_without_any_answer_is_none():
    assert majority_vote([None, None]) is None
    assert majority_vote([None, "4", None]) == 1


def test_maj_at_k_votes_over_the_first_k_of_n_samples_only():
    """n=5, k=3. Prompt 1: first 3 answers 4, 4, 3 -> "4" wins (wrong; gold 3) although "3" leads over
    all 5 -> 0. Prompt 2: 3, 5, 5 -> "5" wins, correct -> 1. Prompt 3: None, 2, None -> "2" wins alone,
    wrong -> 0. Prompt 4: no answer among the first 3 -> 0. maj@3 = 1/4."""
    answers = [
        ["4", "4", "3", "3", "3"],
        ["3", "5", "5", "9", "9"],
        [None, "2", None, "8", "8"],
        [None, None, None, "1", "1"],
    ]
    correct = [
        [False, False, True, True, True],
        [False, True, True, False, False],
        [False, False, False, True, True],
        [False, False, False, True, True],
    ]
    assert maj_at_k(answers, correct, 3) == pytest.approx(0.25)


def test_maj_at_k_tie_goes_to_the_first_answer_and_its_verdict():
    """n=k=4: votes 3, 4, 4, 3 tie 2-2; "3" came first and is correct -> 1; reversed order -> "4" -> 0."""
    assert maj_at_k([["3", "4", "4", "3"]], [[True, False, False, True]], 4) == 1.0
    assert maj_at_k([["4", "3", "3", "4"]], [[False, True, True, False]], 4) == 0.0


def test_mean_accuracy_is_the_mean_over_all_samples():
    """(1 + 0 + 0 + 1 + 1 + 1 + 0 + 0) / 8 = 0.5."""
    assert mean_accuracy([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]) == 0.5


def test_mean_pass_at_1_equals_mean_accuracy_for_binary_rewards():
    correct = [[True, False, False], [True, True, False], [False, False, False]]
    rewards = [[float(c) for c in row] for row in correct]
    assert mean_pass_at_k(correct, 1) == pytest.approx(mean_accuracy(rewards)) == pytest.approx(3 / 9)
