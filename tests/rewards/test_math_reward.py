"""math-verify equivalence cases, format rule, extraction, timeouts."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl2gem.rewards import extract_boxed, score_math


@pytest.mark.parametrize(
    "response, reference",
    [
        ("so x = \\boxed{\\frac{1}{2}}", "0.5"),  # fraction vs decimal
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),  # LaTeX variants
        ("\\boxed{3\\text{ cm}}", "3"),  # units in \text
        ("\\boxed{10\\%}", "10"),  # percent
        ("\\boxed{-7}", "-7"),
        ("\\boxed{1,000}", "1000"),  # thousands separator
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),  # symbolic equality
        ("\\boxed{x = 4}", "4"),  # an equation's right-hand side
        ("first \\boxed{3} then \\boxed{5}", "5"),  # the last box counts
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),  # sets, order-free
    ],
)
def test_equivalent_answers_score_one(response, reference):
    s = score_math(response, reference)
    assert s.reward == 1.0 and s.correct and s.format_ok


@pytest.mark.parametrize(
    "response, reference",
    [("\\boxed{0.51}", "\\frac{1}{2}"), ("\\boxed{5}", "-5"), ("\\boxed{x+1}", "x")],
)
def test_wrong_answers_score_zero(response, reference):
    s = score_math(response, reference)
    assert s.reward == 0.0 and not s.correct and s.format_ok


@pytest.mark.parametrize("response", ["\\boxed{}", "\\boxed{ }", "So \\boxed{.}"])
def test_an_empty_box_is_no_answer_and_gets_no_format_credit(response):
    s = score_math(response, "3")
    assert s.reward == 0.0 and not s.format_ok and s.answer is None


def test_missing_box_scores_zero_unless_allowed():
    s = score_math("The answer is 42.", "42")
    assert s.reward == 0.0 and not s.format_ok and s.answer is None
    assert score_math("The answer is 42.", "42", require_boxed=False).reward == 1.0


@pytest.mark.parametrize(
    ("response", "reference", "correct"),
    [
        ("The answer is 42", "42", True),  # no final period: the words are not parsed as LaTeX products
        ("Answer: $-3$", "-3", True),
        ("So x = 1/2", "0.5", True),
        ("The result is $\\frac{1}{2}$.", "0.5", True),
        ("I think 4, no: 5", "4", False),  # the last answer counts
        ("The answer is 41", "42", False),
    ],
)
def test_unboxed_responses_are_read_by_math_verifys_extraction(response, reference, correct):
    score = score_math(response, reference, require_boxed=False)
    assert score.correct is correct and not score.format_ok
    threaded = ThreadPoolExecutor(1).submit(score_math, response, reference, require_boxed=False).result()
    assert threaded.correct is correct  # off the main thread a worker process scores it


def test_extract_boxed_balances_braces():
    assert extract_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_boxed("nothing") is None


def test_huge_answer_is_rejected_cheaply():
    s = score_math("\\boxed{" + "1+" * 2000 + "1}", "2")
    assert s.reward == 0.0 and s.error == "too_long"


def test_pathological_answer_terminates_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(score_math("\\boxed{9^{9^{9^{9}}}}", "2", timeout=1)))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and out[0].reward == 0.0
    # the worker pool still answers afterwards
    t = threading.Thread(target=lambda: out.append(score_math("\\boxed{0.5}", "\\frac12")))
    t.start()
    t.join(timeout=60)
    assert out[1].reward == 1.0


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed {8}", "8"),  # a space before the brace
        ("the answer is $\\boxed 5$", "5"),  # LaTeX's form without braces
        ("\\boxed{1} then \\boxed {2}", "2"),  # the last box, whichever form
        ("\\boxedness{3}", None),  # another command, no box
    ],
)
def test_boxes_written_with_a_space_or_without_braces_are_read(text, boxed):
    """Both forms are LaTeX's box and scored 0 without a format before."""
    assert extract_boxed(text) == boxed
