"""Reward functions: ``fn(x: RewardInput) -> float``, loaded by ``package.module:function`` path.

A reward sees the sample's tokens and their text (decoded with the run's tokenizer), how the
response ended, the task name and the task's ``meta`` (e.g. ``{"answer": "42"}``). It runs in the
scorer's worker process under a time limit (``worker.py``): raising, hanging or returning something
that is not a finite number is reported, never fatal. A reward that finds no answer to judge in the
response raises ``Unparsed``: the sample scores 0 and the scorer counts it as ``unparsed``.

Built-ins, and the tasks they serve by default (``BUILTIN_TASK_REWARDS``):

- ``math_verify``: 1 when math-verify finds that the response states ``meta["answer"]``, 0 when it
  states another, ``Unparsed`` when it states none (task ``math``: JSONL/Parquet data sets;
  ``tasks/math_verified.py``);
- ``math_answer``: 1 when the response's ``#### x`` / ``\\boxed{x}`` states ``meta["answer"]``, else 0
  (task ``addchain``; ``tasks/math_answer.py``);
- ``parity_reward``: 1 when the response has an even number of tokens (task ``scripted``, the
  runtime tests' scripted engine).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from april_async.tasks import math_answer as _math


@dataclass(frozen=True)
class RewardInput:
    """What a reward function is given about one finished sample."""

    prompt_ids: list[int]
    response_ids: list[int]
    prompt_text: str
    response_text: str
    finish_reason: str
    """``stop`` (end-of-sequence or a stop token) or ``length`` (the token budget ran out)."""
    task: str
    meta: dict[str, Any] = field(default_factory=dict)


Reward = Callable[[RewardInput], float]


class RewardConfigError(ValueError):
    """A reward path that cannot be loaded; the message names the path."""


class Unparsed(Exception):
    """Raised by a reward when the response states no answer it can read: not the reward's failure
    but the policy's, so the scorer answers reward 0 (and counts it as ``unparsed``)."""


def math_verify(x: RewardInput) -> float:
    """1.0 when math-verify finds that the response states ``meta["answer"]``, 0.0 when it states
    another; ``Unparsed`` when it states none."""
    # Imported at the first call (math-verify and sympy: half a second, well inside a call's time
    # limit): every scorer loads every built-in reward, and most runs score no ``math`` task.
    from april_async.tasks import math_verified

    reward = math_verified.score(x.response_text, _gold(x))
    if reward is None:
        raise Unparsed(f"math-verify reads no answer in the response ({len(x.response_text)} characters)")
    return reward


def math_answer(x: RewardInput) -> float:
    """1.0 when the response's final answer (``#### x`` or ``\\boxed{x}``) equals ``meta["answer"]``."""
    return _math.score(x.response_text, _gold(x))


def _gold(x: RewardInput):
    if "answer" not in x.meta:
        raise KeyError(f"task {x.task!r}: meta has no 'answer' (keys: {sorted(x.meta)})")
    return x.meta["answer"]


def parity_reward(x: RewardInput) -> float:
    """For the scripted test engine: 1.0 when the response has an even number of tokens."""
    return 1.0 if len(x.response_ids) % 2 == 0 else 0.0


BUILTIN_TASK_REWARDS: Mapping[str, str] = {
    "scripted": f"{__name__}:parity_reward",
    "addchain": f"{__name__}:math_answer",
    "math": f"{__name__}:math_verify",
}
"""The reward of each built-in task, unless the scorer's ``rewards`` names another."""


def import_named(path: str, *, what: str, error: type[Exception], shape: str) -> tuple[object, str, str]:
    """``package.module:Name`` -> (the object, the module's name, ``Name``), None for an object the
    module does not have; a path of another shape, or a module that cannot be imported, is
    ``error`` naming ``what`` and the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{what} {path!r} must look like '{shape}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{what} {path!r}: cannot import {module_name!r} ({e})") from None
    return getattr(module, attr, None), module_name, attr


def load_reward(path: str) -> Reward:
    """``package.module:function`` -> the function; a bad path is a ``RewardConfigError``."""
    fn, module_name, attr = import_named(path, what="reward", error=RewardConfigError,
                                         shape="package.module:function")
    if not callable(fn):
        raise RewardConfigError(f"reward {path!r}: {module_name} has no function {attr!r}")
    return fn


def reward_path(task: str, *, default: str, overrides: Mapping[str, str]) -> str:
    """The reward a task is scored by: the scorer's per-task entry, else the built-in task's,
    else the default."""
    return overrides.get(task) or BUILTIN_TASK_REWARDS.get(task) or default
