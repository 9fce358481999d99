"""The math-answer reward: extraction of ``#### x`` and ``\\boxed{x}``, normalisation, comparison."""

import pytest

from april_async.scorer.rewards import RewardInput, math_answer
from april_async.tasks.math_answer import answers_match, extract_answer, normalize, parse_number, score


@pytest.mark.parametrize("text, answer", [
    ("Janet has 3 eggs.\n#### 18", "18"),
    ("#### 4\nwait, recount\n#### 5", "5"),  # the last one
    ("#### 7 apples\n", "7 apples"),  # to the end of its line
    (r"so the answer is $\boxed{42}$.", "42"),
    (r"\boxed{1} then \boxed{\frac{3}{4}}", r"\frac{3}{4}"),  # the last box, nested braces
    (r"\boxed{x^{2}+1}", "x^{2}+1"),
    (r"#### 3 but really \boxed{4}", "4"),  # whichever comes last
    (r"\boxed{4} no wait #### 5", "5"),
    (r"\fbox{9}", "9"),
    (r"\boxed{2} and an unclosed \boxed{3", "2"),
])
def test_extracts_the_last_stated_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text", ["no answer here", "####", "####   \n", r"\boxed{unclosed", ""])
def test_no_stated_answer_is_none(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize("raw, canonical", [
    (" 1,234. ", "1234"),
    ("$42$", "42"),
    (r"\text{42}", "42"),
    ("1{,}000", "1000"),
    (r"50\%", "50"),
    ("x + 1", "x+1"),
    ("12,34", "12,34"),  # not a thousands separator: left alone
])
def test_normalize(raw, canonical):
    assert normalize(raw) == canonical


@pytest.mark.parametrize("predicted, gold, same", [
    ("42.0", "42", True),
    ("42", 42, True),
    ("0.5", r"\frac{1}{2}", True),
    ("-0.75", r"-\dfrac{3}{4}", True),
    ("1/2", r"\frac12", True),
    ("1,000,000", "1000000", True),
    ("$18.00", "18", True),
    ("41", "42", False),
    ("42.01", "42", False),
    ("1/0", "1/0", True),  # not a number on either side: compared as text
    ("x+1", "x + 1", True),
    (None, "42", False),
])
def test_answers_match(predicted, gold, same):
    assert answers_match(predicted, gold) is same


def test_parse_number_refuses_non_finite_and_text():
    assert parse_number("inf") is None and parse_number("nan") is None and parse_number("abc") is None
    assert parse_number(r"\frac{1}{0}") is None and parse_number("3.25") * 4 == 13


def test_score_and_the_reward_plugin():
    assert score("5+3=8\n#### 8", "8") == 1.0 and score("#### 9", "8") == 0.0 and score("8", "8") == 0.0
    x = RewardInput(prompt_ids=[1], response_ids=[2], prompt_text="q", response_text=r"\boxed{8}",
                    finish_reason="stop", task="math", meta={"answer": "8"})
    assert math_answer(x) == 1.0
    with pytest.raises(KeyError, match="meta has no 'answer'"):
        math_answer(RewardInput([1], [2], "q", "#### 8", "stop", "math", {}))
