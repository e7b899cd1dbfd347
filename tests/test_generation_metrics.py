"""The generation task's pure parts against hand-computed cases: pass@k, the Kaplan-Meier divergence curve,
repeated n-grams, token similarity, the binned KLD curve, the accuracy MDE, the answer checkers and the builtin
prompts (kveval/tasks/generation/{metrics,checkers,prompts}.py). No model."""

from __future__ import annotations

import itertools
import math

import pytest

from kveval.errors import KvevalError
from kveval.tasks.generation.checkers import CHECKERS, check_answer, check_checker, last_boxed, strip_thinking
from kveval.tasks.generation.metrics import (
    accuracy_mde,
    binned_curve,
    levenshtein,
    pass_at_k,
    prompts_to_decide,
    repeated_ngram_share,
    survival,
    token_similarity,
)
from kveval.tasks.generation.prompts import ID_PATTERN, KINDS, builtin_prompts

# ---------------------------------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [(5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 0, 3, 0.0),
                                                        (5, 5, 1, 1.0), (5, 5, 5, 1.0), (10, 1, 10, 1.0)])
def test_pass_at_k_by_hand(n, c, k, expected):
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_combinatorial_formula():
    for n in range(1, 13):
        for c, k in itertools.product(range(n + 1), range(1, n + 1)):
            naive = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(naive, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 500, 100) == pytest.approx(1.0)


@pytest.mark.parametrize(("n", "c", "k"), [(5, 6, 1), (5, 2, 6), (-1, 0, 0), (5, -1, 1), (5, 1, -1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# -------------------------------------------------------------------------------------------------- survival


def test_survival_without_censoring():
    # divergences at steps 1, 3, 3, 7: at risk 4, 3, 1; S = 3/4, 3/4 * 1/3 = 1/4, 0
    out = survival([3, 1, 7, 3], [10, 10, 10, 10])
    assert out["steps"] == [1, 3, 7]
    assert out["survival"] == pytest.approx([0.75, 0.25, 0.0])
    assert out["at_risk"] == [4, 3, 1]
    assert out["median"] == 3  # the first step with S <= 0.5
    assert (out["n"], out["diverged"], out["end"]) == (4, 4, 7)


def test_survival_with_censoring():
    # prompt 1 is identical for its 2 tokens (censored: at risk at steps 0 and 1 only), prompt 3 for its 6
    # step 1: at risk all 5, one diverges -> 4/5; step 4: at risk {T=4, T=5, h=6} -> 4/5 * 2/3 = 0.533
    # step 5: at risk {T=5, h=6} -> 0.533 * 1/2 = 0.267, the first step at or below 0.5
    out = survival([4, None, 5, None, 1], [8, 2, 8, 6, 8])
    assert out["steps"] == [1, 4, 5]
    assert out["at_risk"] == [5, 3, 2]
    assert out["survival"] == pytest.approx([0.8, 0.8 * 2 / 3, 0.8 * 2 / 3 * 1 / 2])
    assert out["median"] == 5
    assert (out["n"], out["diverged"], out["end"]) == (5, 3, 5)


def test_survival_censored_at_the_divergence_step_is_still_at_risk_before_it():
    # a censored horizon of 3 means identical at steps 0, 1, 2: at risk at step 2, not at step 3
    out = survival([2, None, 3], [5, 3, 5])
    assert out["at_risk"] == [3, 1]
    assert out["survival"] == pytest.approx([2 / 3, 0.0])


def test_survival_all_censored_has_no_median():
    out = survival([None, None, None], [16, 16, 8])
    assert out["steps"] == [] and out["survival"] == []
    assert out["median"] is None and out["median_ci95"] == [None, None]
    assert (out["n"], out["diverged"], out["end"]) == (3, 0, 15)


def test_survival_empty_and_bad_input():
    assert survival([], [])["median"] is None
    with pytest.raises(ValueError):
        survival([1], [1, 2])
    with pytest.raises(ValueError):
        survival([-1], [4])


def test_survival_median_interval_brackets_the_median():
    # 40 prompts diverging at steps 0..39 (one each): S(t) = 1 - (t+1)/40, median at t = 19
    out = survival(list(range(40)), [64] * 40)
    lo, hi = out["median_ci95"]
    assert out["median"] == 19
    assert lo is not None and hi is not None and lo < 19 < hi
    # log-log Greenwood band: lifelines 0.30.3 (KaplanMeierFitter().fit(T, E), median_survival_times of its
    # confidence_interval_) gives [13, 25] on these data, as on the two cases below (its median takes S < 0.5)
    assert (lo, hi) == (13, 25)
    assert survival([4, None, 5, None, 1], [8, 2, 8, 6, 8])["median_ci95"] == [1, None]


def test_survival_median_interval_open_above_with_few_divergences():
    out = survival([0, 1, 2, None, None, None], [10] * 6)
    assert out["survival"] == pytest.approx([5 / 6, 4 / 6, 3 / 6])
    assert out["median"] == 2  # S(2) = 0.5 exactly
    assert out["median_ci95"] == [0, None]  # the band's upper curve never reaches 0.5


# ------------------------------------------------------------------------- repetition, similarity, KLD curve


def test_repeated_ngram_share():
    assert repeated_ngram_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_share([7] * 10) == pytest.approx(6 / 7)  # 7 4-grams, all but the first repeat
    # bigrams of 1 2 1 2 3 1 2: (1,2) (2,1) (1,2)* (2,3) (3,1) (1,2)*
    assert repeated_ngram_share([1, 2, 1, 2, 3, 1, 2], n=2) == pytest.approx(2 / 6)
    assert repeated_ngram_share([1, 1, 1, 1]) == 0.0  # shorter than n + 1
    assert repeated_ngram_share([]) == 0.0
    with pytest.raises(ValueError):
        repeated_ngram_share([1, 2], n=0)


def test_token_similarity_by_hand():
    assert token_similarity([], []) == 1.0
    assert token_similarity([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_similarity([1, 2, 3], []) == 0.0
    assert token_similarity([1, 2, 3, 4], [1, 9, 3, 4]) == pytest.approx(0.75)  # one substitution
    assert token_similarity([1, 2, 3, 4], [1, 3, 4]) == pytest.approx(0.75)  # one deletion
    assert levenshtein([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == 4
    assert levenshtein([1, 2, 3], [4, 5, 6]) == 3


def _naive_levenshtein(a, b):
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def test_levenshtein_matches_the_textbook_programme():
    import random

    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(12))]
        b = [rng.randrange(4) for _ in range(rng.randrange(12))]
        assert levenshtein(a, b) == _naive_levenshtein(a, b), (a, b)


def test_token_similarity_refuses_overlong_sequences():
    with pytest.raises(ValueError):
        token_similarity([0] * 32769, [0])


def test_binned_curve_by_hand():
    # horizon 4, 2 bins: steps 0-1 and 2-3; step 4 is past the horizon
    out = binned_curve([[1.0, 3.0, 5.0, 7.0, 100.0], [2.0]], bins=2, horizon=4)
    assert out["edges"] == [0.0, 2.0, 4.0]
    assert out["mean"] == pytest.approx([2.0, 6.0])  # (1 + 3 + 2) / 3, (5 + 7) / 2
    assert out["count"] == [3, 2]
    # least squares over (0,1) (1,3) (2,5) (3,7) (0,2): Sxy = 12.4, Sxx = 6.8, per 1,000 steps
    assert out["slope"] == pytest.approx(12.4 / 6.8 * 1000)


def test_binned_curve_empty_bins_and_no_slope():
    out = binned_curve([[0.5], [0.25]], bins=3, horizon=9)
    assert out["mean"] == [pytest.approx(0.375), None, None]
    assert out["count"] == [2, 0, 0] and out["slope"] is None
    assert binned_curve([], bins=2, horizon=4)["mean"] == [None, None]
    with pytest.raises(ValueError):
        binned_curve([[math.nan]], bins=1, horizon=4)


# ----------------------------------------------------------------------------------------------- power


def test_accuracy_mde_and_prompts_to_decide_agree():
    from kveval.stats import MDE_FACTOR
    from kveval.tasks.generation.metrics import _z_factor

    assert _z_factor(0.05, 0.8) == pytest.approx(MDE_FACTOR)
    mde = accuracy_mde(200, 0.6)
    # d = 2.80 sqrt((0.24 + q(1-q)) / 200) with q = 0.6 - d: about 13.7 points
    assert 12 < mde < 15
    q = 0.6 - mde / 100
    assert mde / 100 == pytest.approx(MDE_FACTOR * math.sqrt((0.24 + q * (1 - q)) / 200), rel=1e-6)
    assert prompts_to_decide(0.6, mde) == pytest.approx(200, abs=1)
    assert accuracy_mde(800, 0.6) < mde  # more prompts, smaller drops
    assert prompts_to_decide(0.6, 5.0) > prompts_to_decide(0.6, 10.0)


def test_accuracy_mde_undetectable_and_bad_input():
    assert accuracy_mde(3, 0.1) == math.inf  # even a drop to 0% is within the noise of 3 prompts
    with pytest.raises(ValueError):
        accuracy_mde(0, 0.5)
    with pytest.raises(ValueError):
        prompts_to_decide(0.1, 20.0)  # a drop below 0% accuracy
    with pytest.raises(ValueError):
        accuracy_mde(10, 0.5, alpha=1.5)


# ---------------------------------------------------------------------------------------------- checkers

CHECKS = [
    # (output, answer, checker, expected)
    ("Paris", "paris", "exact", True),
    ("  **Paris**.  \nMore text", "Paris", "exact", True),
    ("The capital of France is Paris.", "Paris", "exact", True),
    ('The opposite of "hot" is "cold".', "cold", "exact", True),
    ("Buenos Aires is the capital.", "Buenos Aires", "exact", True),
    ("The capital is Paris or Rome.", "Paris", "exact", False),
    ("\n\nI think\nParis", "Paris", "exact", False),  # only the first non-empty line
    ("Paris", "", "exact", False),
    ("The answer is 1,000 apples", "1000", "numeric", True),
    ("-3.5 degrees, then 4", "-3.5", "numeric", True),
    ("3 + 4 = 7", "7", "numeric", False),  # the first number is 3
    ("3 + 4 = 7", "7", "last_number", True),
    ("range 3-4", "4", "last_number", True),  # a hyphen after a word character is no minus sign
    ("it costs $12.50.", "12.5", "last_number", True),
    ("0.1 + 0.2 = 0.30000000000000004", "0.3", "last_number", True),  # within 1e-6 relative
    ("no number here", "5", "last_number", False),
    ("1,000,001", "1000000", "numeric", False),  # whole numbers compare exactly
    ("2.0000000001", "2", "numeric", True),
    ("1,2,3", "3", "last_number", True),
    ("So #### 1,234", "1234", "gsm8k", True),
    ("#### 5 then later #### -2", "-2", "gsm8k", True),
    ("#### 5 then later #### none", "5", "gsm8k", False),
    ("the answer is 42", "42", "gsm8k", False),
    (r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}", "boxed", True),
    (r"so \boxed{\frac{1}{2}}", "0.5", "boxed", True),
    (r"\boxed{1} then \boxed{ -\dfrac{1}{2} }", "-1/2", "boxed", True),
    (r"\boxed{x^{2}+1}", "x^{2} + 1", "boxed", True),
    (r"\boxed{\frac{1}{2", "1/2", "boxed", False),  # never closed: a truncated generation
    (r"\boxed{3}", "4", "boxed", False),
    ("Answer: 42 (final)", r"\b42\b", "regex", True),
    ("Answer: 420", r"\b42\b", "regex", False),
    ("anything", "(unclosed", "regex", False),  # never raises
    ("Paris", "Paris", "no-such-checker", False),
]


@pytest.mark.parametrize(("output", "answer", "checker", "expected"), CHECKS)
def test_check_answer_table(output, answer, checker, expected):
    assert check_answer(output, answer, checker) is expected


@pytest.mark.parametrize("output", ["", "\x00\xff" * 50, "9" * 5000, "\\boxed{" * 1000, "#### " * 100,
                                    "{" * 10_000, "-" * 1000 + "1"])
def test_check_answer_never_raises(output):
    for checker in CHECKERS:
        assert check_answer(output, "1", checker) in (True, False)


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>7 is prime?</think>\n\n 42 ", "42"),
    ("<think>a</think>x<think>b</think>y", "xy"),
    ("<think>still thinking 42", ""),  # unterminated: no answer
    ("the template opened it</think> 42", "42"),
    ("  plain  ", "plain"),
])
def test_strip_thinking(text, expected):
    assert strip_thinking(text) == expected


def test_last_boxed_takes_the_last_balanced_one():
    assert last_boxed(r"\boxed{1} and \boxed {\frac{a}{b}} end") == r"\frac{a}{b}"
    assert last_boxed("no box") is None


def test_check_checker_refusals():
    check_checker("numeric", "not a number")  # numeric answers are the file reader's concern
    check_checker("regex", r"\d+")
    with pytest.raises(KvevalError, match=r"unknown answer checker 'numerc'; the checkers are exact, .*; did you mean 'numeric'\?$"):
        check_checker("numerc", "1")
    with pytest.raises(KvevalError, match="not a valid Python regular expression") as info:
        check_checker("regex", "(a")
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- builtin prompts


def test_builtin_prompts_are_seeded_and_unique():
    first, again = builtin_prompts(10, ["once upon a time", "the river"], 0), builtin_prompts(10, ["once upon a time",
                                                                                                  "the river"], 0)
    other = builtin_prompts(10, ["once upon a time", "the river"], 1)
    assert first == again
    assert [p.text for p in first] != [p.text for p in other]
    ids = [p.id for p in first]
    assert len(ids) == len(set(ids)) == 10 * len(KINDS) + 2
    assert all(ID_PATTERN.fullmatch(i) for i in ids)
    assert {p.kind for p in first} == {*KINDS, "continuation"}


def test_builtin_prompts_have_checkable_answers():
    prompts = builtin_prompts(50, ["text"], 3)
    for p in prompts:
        if p.kind == "continuation":
            assert (p.id, p.answer, p.checker) == ("cont-0", None, None)
            continue
        assert p.id.startswith(f"{p.kind}-") and p.answer and p.checker in CHECKERS
        check_checker(p.checker, p.answer)
        assert check_answer(p.answer, p.answer, p.checker)  # the answer itself passes


def test_builtin_prompts_per_kind_are_a_prefix():
    # growing tasks_per_kind keeps the prompts already drawn (a resumed run with more prompts reuses its records)
    small, large = builtin_prompts(3, [], 7), builtin_prompts(6, [], 7)
    assert all(p in large for p in small)


# ------------------------------------------------------------------------------------------------- aggregate


def _generation_records(kld: list) -> list[dict]:
    """The baseline's and policy int8's greedy records of one open-ended prompt, and int8's FP-path record."""
    def rec(who, unit, values):
        return {"key": f"generation/p0/{who}/{unit}", "task": "generation", "prompt": "p0", "policy": who,
                "unit": unit, "tokens": [1, 2, 3], "ended": "length", "kld": values, "text": "abc"}

    return [rec("baseline", "greedy", [0.0, 0.0, 0.0]), rec("int8", "greedy", kld), rec("int8", "fp_path", [0.1] * 3)]


def test_aggregate_refuses_a_non_finite_record_in_one_line_naming_it():
    from kveval.tasks.generation.aggregate import aggregate
    from kveval.tasks.generation.params import Params
    from kveval.tasks.generation.prompts import Prompt

    prompts, params = [Prompt("p0", "text")], Params(max_new_tokens=3, kld_bins=1)
    fine = aggregate(_generation_records([0.1, 0.2, 0.3]), prompts, ["int8"], params)
    assert fine["policies"]["int8"]["gen_kld_mean"] == pytest.approx(0.2)
    for bad in (math.nan, math.inf):
        with pytest.raises(KvevalError) as err:
            aggregate(_generation_records([0.1, bad, 0.3]), prompts, ["int8"], params)
        assert "generation/p0/int8/greedy" in str(err.value) and "kld" in str(err.value)
        assert f"{bad!r} at step 1" in str(err.value) and "\n" not in str(err.value)
