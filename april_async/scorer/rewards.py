"""Reward functions. A reward is ``fn(prompt, response, task, meta) -> float``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

Reward = Callable[[list[int], list[int], str, dict], float]


def parity_reward(prompt: list[int], response: list[int], task: str, meta: dict) -> float:
    """For the scripted test engine: 1 when the response has an even number of tokens."""
    return 1.0 if len(response) % 2 == 0 else 0.0


def load_reward(path: str) -> Reward:
    """``package.module:function`` -> the function; a bad path is a clear ``ValueError``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {path!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {path!r}: {module_name} has no function {attr!r}")
    return fn
