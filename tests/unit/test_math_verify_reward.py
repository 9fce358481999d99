"""The math task's reward: math-verify judges equivalent answers equal, wrong ones 0, reads nothing in
garbage (``Unparsed``), stays within its time bound on pathological answers, and works off the
main thread (where math-verify's signal-based limits cannot be used)."""

import json
import threading
import time

import pytest

from april_async.scorer.config import ScorerConfig
from april_async.scorer.rewards import BUILTIN_TASK_REWARDS, RewardInput, Unparsed, math_verify, reward_path
from april_async.tasks import math_verified
from april_async.tasks.datasets import load_problems

SLACK_S = 7.0
"""On top of a limit, for a loaded CI machine (5.4 s against a 3 s limit was seen with both cores
busy); unbounded, the first answer below computes a number of ~10^8 digits: minutes."""


def sample(text: str, answer, task: str = "math") -> RewardInput:
    return RewardInput(prompt_ids=[1], response_ids=[2], prompt_text="q", response_text=text,
                       finish_reason="stop", task=task, meta={"answer": answer})


@pytest.mark.parametrize("response, gold", [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\dfrac{3}{4}}", "3/4"),
    (r"The solutions form $\boxed{\{1,2\}}$", r"\{1,2\}"),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}"),  # a set: order does not matter
    ("Solving, we get $x=3$.", "3"),
    ("Solving, we get $x = 3$.", "x=3"),
    (r"\boxed{[1,2)}", "[1,2)"),  # an interval
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),  # symbolic equality
    ("She pays 2*617 = 1234 dollars.\n#### 1,234", "1234"),  # thousands separators, either side
    ("#### 1234", "1,234"),
    (r"$\boxed{1{,}234}$", "1234"),
    ("The total is 1,234 dollars.", "#### 1,234"),  # a gold answer that still holds GSM8K's ####
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72"),
    ("#### 18", 18),  # a number, as JSON gives it
    ("#### 42.0", "42"),
])
def test_equivalent_answers_score_one(response, gold):
    assert math_verify(sample(response, gold)) == 1.0


@pytest.mark.parametrize("response, gold", [
    ("#### 71", "72"),
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{\{1,3\}}", r"\{1,2\}"),
    (r"\boxed{(1,2)}", "[1,2)"),  # open where the gold is closed
    ("$x=4$", "3"),
    ("The answer is 1,235.", "1,234"),
])
def test_wrong_answers_score_zero(response, gold):
    assert math_verify(sample(response, gold)) == 0.0


@pytest.mark.parametrize("response", ["", "   \n", "I do not know.", "garbage !! ###", "####", r"\boxed{}",
                                      "$$"])
def test_a_response_without_an_answer_is_unparsed_not_an_error(response):
    with pytest.raises(Unparsed, match="reads no answer"):
        math_verify(sample(response, "7"))


def test_a_bad_gold_answer_or_none_is_the_sample_error():
    with pytest.raises(math_verified.GoldAnswerError, match="gold answer '####  ': math-verify reads no"):
        math_verify(sample("#### 7", "####  "))
    with pytest.raises(KeyError, match="meta has no 'answer'"):
        math_verify(RewardInput([1], [2], "q", "#### 7", "stop", "math", {}))


def test_gsm8k_records_as_the_data_set_loads_them(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    record = {"question": "How much?", "answer": "617 * 2 = <<617*2=1234>>1234\n#### 1,234"}
    path.write_text(json.dumps(record) + "\n")
    (problem,) = load_problems(path)
    assert problem.task == "math" and reward_path("math", default="", overrides={}).endswith(":math_verify")
    assert math_verify(sample("So 617 * 2 = 1234.\n#### 1234", problem.meta["answer"])) == 1.0
    assert math_verify(sample("#### 1243", problem.meta["answer"])) == 0.0


def test_addchain_keeps_its_own_reward():
    assert BUILTIN_TASK_REWARDS["addchain"] == "april_async.scorer.rewards:math_answer"
    assert BUILTIN_TASK_REWARDS["math"] == "april_async.scorer.rewards:math_verify"


def test_the_worst_case_fits_the_scorers_default_time_limit():
    # Else a pathological answer would be killed as reward_timeout instead of scoring 0.
    assert math_verified.WORST_CASE_S < ScorerConfig().timeout_s


@pytest.mark.parametrize("response", [
    r"$\boxed{9^{9^{9^{9}}}}$",  # verify would compute a number with ~10^8 digits
    "$" + "(" * 300 + "1" + ")" * 300 + "$",  # parsing runs out of time
])
def test_a_pathological_answer_is_bounded_in_time(response):
    t0 = time.monotonic()
    try:
        assert math_verify(sample(response, "1")) == 0.0
    except Unparsed:
        pass
    assert time.monotonic() - t0 < math_verified.WORST_CASE_S + SLACK_S


def test_works_off_the_main_thread():
    # math-verify's signal.alarm limits raise ValueError there: the reward turns them off.
    results = []
    t = threading.Thread(target=lambda: results.append(math_verify(sample(r"\boxed{\frac{1}{2}}", "0.5"))))
    t.start()
    t.join(30)
    assert results == [1.0]
