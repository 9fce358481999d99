"""``april_async/agents/env.py`` (the environment's step, its checks, the step cache) and the
calculator environment of the tool-using addition chains (``tasks/addchain_calc.py``)."""

from __future__ import annotations

import math

import pytest

from april_async.agents.env import (MAX_OBSERVATION_CHARS, BadStep, Continue, Done, Environment,
                                    RewardEnvironment, StepCache, Trajectory, Turn, checked)
from april_async.scorer.rewards import RewardInput, math_answer
from april_async.tasks.addchain_calc import CalcEnvironment, CalcError, call_in, evaluate
from april_async.model.tokenizer import CharTokenizer


def trajectory(*texts: str, finish: str = "stop", meta: dict | None = None, sample_id: int = 7) -> Trajectory:
    turns = [Turn(policy_ids=[ord(c) for c in t], observation_ids=[1, 2] if i < len(texts) - 1 else [],
                  policy_text=t) for i, t in enumerate(texts)]
    return Trajectory(sample_id=sample_id, prompt_ids=[9, 9], turns=turns, finish_reason=finish,
                      task="addchain", meta={"answer": "57"} if meta is None else meta,
                      prompt_text="17+8x5\n")


def test_a_reward_is_an_environment_of_one_step_and_sees_the_whole_response():
    seen: list[RewardInput] = []

    def reward(x: RewardInput) -> float:
        seen.append(x)
        return math_answer(x)

    env = RewardEnvironment(reward)
    assert isinstance(env, Environment)
    assert env.step(trajectory("5) 17+8=25\n#### 57")) == Done(1.0)
    t = trajectory("calc{17+8x5}", "#### 57")
    assert env.step(t) == Done(1.0)
    x = seen[-1]
    assert x.response_ids == [*t.turns[0].policy_ids, 1, 2, *t.turns[1].policy_ids]  # observations in the ids
    assert (x.response_text, x.prompt_text, x.task) == ("#### 57", "17+8x5\n", "addchain")
    assert x.meta == {"answer": "57"}


def test_a_step_id_is_the_sample_and_the_turn():
    assert trajectory("a").step_id == "7:0" and trajectory("a", "b", "c").step_id == "7:2"
    assert trajectory("a", "b").turn == 1


@pytest.mark.parametrize("value, match", [
    (1.0, "not Continue"), (None, "not Continue"), (Done(math.nan), "finite"), (Done("1"), "finite"),
    (Done(True), "finite"), (Continue(3), "must be a string"), (Continue({"content": 5}), "must be a string"),
    (Continue({"role": "user", "content": "x"}), "role 'user'"), (Continue("a\x00b"), "NUL"),
    (Continue("x" * (MAX_OBSERVATION_CHARS + 1)), "characters"),
])
def test_a_malformed_step_is_a_bad_step_naming_what_came_back(value, match):
    with pytest.raises(BadStep, match=match):
        checked(value)


def test_well_formed_steps_pass_their_checks():
    assert checked(Done(1)) == Done(1.0) and isinstance(checked(Done(1)).reward, float)
    assert checked(Continue("= 5")) == Continue("= 5")
    msg = {"role": "tool", "content": "= 5", "name": "calc"}
    assert checked(Continue(msg)) == Continue(msg)


def test_the_step_cache_answers_a_repeat_and_forgets_ended_samples_and_the_oldest():
    cache = StepCache(capacity=3)
    cache.put(1, 0, Continue("= 1"))
    cache.put(1, 1, Done(1.0))
    assert cache.get(1, 0) == Continue("= 1") and cache.get(2, 0) is None and cache.repeats == 1
    cache.put(2, 0, Done(0.0))
    cache.put(3, 0, Done(0.0))  # over capacity: (1, 1), the least recently used, goes
    assert cache.get(1, 1) is None and cache.get(1, 0) is not None and len(cache) == 3
    cache.forget(1)
    assert cache.get(1, 0) is None and len(cache) == 2
    with pytest.raises(ValueError, match="capacity"):
        StepCache(0)


@pytest.mark.parametrize("expression, value", [("17+8x5", 57), ("25+8+8", 41), ("3", 3), ("0x9+4", 4),
                                               (" 1 + 2x3 ", 7)])
def test_the_calculator_reads_the_tasks_notation(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["", "17-8", "2*3", "8x", "x5", "1x2x3", "import os", "9" * 13,
                                        "1++2"])
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(CalcError):
        evaluate(expression)


def test_a_call_ends_a_turn_only_on_its_last_line():
    assert call_in("5) 17+8=25\ncalc{25+8x4}") == "25+8x4"
    assert call_in("calc{25+8x4}\n") == "25+8x4"
    assert call_in("calc{25+8x4}\n4) 25+8=33") is None and call_in("no call") is None


def test_the_calculator_environment_answers_calls_and_ends_with_the_final_answers_reward():
    env = CalcEnvironment()
    assert env.step(trajectory("calc{17+8x5}")) == Continue("\n= 57\n")
    assert env.step(trajectory("calc{17+8x5}", "#### 57")) == Done(1.0)
    assert env.step(trajectory("calc{17+8x5}", "#### 58")) == Done(0.0)
    refused = Continue("\nerror bad expression\n")
    CharTokenizer().encode(refused.observation)  # in the character tokenizer's alphabet
    assert env.step(trajectory("calc{17-8}")) == refused
    assert env.step(trajectory("nothing to do")) == Done(0.0)  # neither a call nor an answer
    assert env.step(trajectory("calc{17+8x5}", finish="length")) == Done(0.0)  # cut by its budget
    assert env.step(trajectory("#### 57\ncalc{1}")) == Done(1.0)  # an answer ends it, whatever follows
    # the turn limit: the last allowed turn's call is not answered
    assert env.step(trajectory(*["calc{1}"] * 3, meta={"answer": "57", "max_turns": 3})) == Done(0.0)
    assert env.step(trajectory(*["calc{1}"] * 2, meta={"answer": "57", "max_turns": 3})) == Continue("\n= 1\n")
    last = Trajectory(sample_id=7, prompt_ids=[9], turns=[Turn([1], [], "calc{1+1}")], finish_reason="stop",
                      task="addchain", meta={"answer": "2"}, last_turn=True)
    assert env.step(last) == Done(0.0)  # the broker takes no observation after this turn
    with pytest.raises(KeyError, match="no 'answer'"):
        env.step(trajectory("#### 57", meta={}))
    with pytest.raises(ValueError, match="max_turns"):
        CalcEnvironment(max_turns=0)
