"""Environments: a task that answers a finished policy turn with an observation or a reward.

    step(trajectory) -> Continue(observation) | Done(reward)

The scorer steps an environment in its worker processes (``docs/agents.md``): a turn that ends in a
tool call comes back with the tool's answer, and the next turn is leased like a recycled partial;
a turn that ends the conversation comes back with its reward. A single-turn task is an environment
whose first step is ``Done``: ``RewardEnvironment`` wraps any reward function
(``fn(RewardInput) -> float``) as one, so every reward keeps working unchanged.

A step may run twice: the broker sends a score request again after ``score_timeout_s``. The step's
result is kept by ``(sample_id, turn)`` (``StepCache``) and a repeat is answered from it; a tool
with side effects is given the step id (``Trajectory.step_id``) to make its own effect idempotent.

What a step returns is checked (``checked``): anything but a ``Continue`` with a string or a
message, or a ``Done`` with a finite number, is a ``BadStep`` naming what came back.

No torch here: the scorer and the broker's planner import it.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from april_async.scorer.rewards import RewardInput, import_named

MAX_OBSERVATION_CHARS = 64 * 1024
"""The longest observation text a step may return; longer ones are a ``BadStep`` (a tool should cut
its own output, saying so, rather than fill the context)."""


@dataclass(frozen=True)
class Turn:
    """One policy turn and the observation that answered it (empty for the turn being stepped)."""

    policy_ids: list[int]
    observation_ids: list[int] = field(default_factory=list)
    policy_text: str = ""
    """The policy's ids decoded with the run's tokenizer, for the environment to read."""


@dataclass(frozen=True)
class Trajectory:
    """What an environment's step sees: the prompt and every turn so far, the last one just ended."""

    sample_id: int
    prompt_ids: list[int]
    turns: list[Turn]
    finish_reason: str
    """How the last turn ended: ``stop`` (end of turn or a stop token) or ``length`` (its budget)."""
    task: str
    meta: dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""
    lease_id: int | None = None
    """The lease that finished the last turn: a request sent again carries the same one, and a
    sample restarted from nothing a new one (``step_id``)."""
    last_turn: bool = False
    """No observation is taken after this turn (the trajectory's turn limit, or no room left, or a
    broker older than protocol 1.9): the step must end it with ``Done``."""

    @property
    def turn(self) -> int:
        """The number of the turn that just ended, from 0."""
        return len(self.turns) - 1

    @property
    def step_id(self) -> str:
        """``"<sample_id>:<turn>"``, with ``:<lease_id>`` where the lease is known: the same for every
        run of this step (a request sent again), different for any other step, also that of the same
        turn of a sample restarted from nothing."""
        base = f"{self.sample_id}:{self.turn}"
        return base if self.lease_id is None else f"{base}:{self.lease_id}"

    @property
    def last_text(self) -> str:
        return self.turns[-1].policy_text if self.turns else ""

    def reward_input(self) -> RewardInput:
        """The trajectory as a single-turn reward sees a sample: every id after the prompt as the
        response (observations included), the last turn's text as the response text."""
        response = [i for t in self.turns for i in (*t.policy_ids, *t.observation_ids)]
        return RewardInput(prompt_ids=list(self.prompt_ids), response_ids=response,
                           prompt_text=self.prompt_text, response_text=self.last_text,
                           finish_reason=self.finish_reason, task=self.task, meta=dict(self.meta))


@dataclass(frozen=True)
class Continue:
    """The conversation goes on: ``observation`` is the tool's answer, a text (sent as a tool
    message) or a whole message (``{"role": "tool", "content": ..., ...}``), rendered into tokens
    by the scorer with the chat template."""

    observation: str | dict[str, Any]


@dataclass(frozen=True)
class Done:
    """The conversation ends with ``reward``."""

    reward: float


Step = Continue | Done


class BadStep(ValueError):
    """A step returned something that is neither a well-formed ``Continue`` nor a ``Done``."""


@runtime_checkable
class Environment(Protocol):
    def step(self, trajectory: Trajectory) -> Step: ...


class EnvironmentConfigError(ValueError):
    """An environment path that cannot be loaded; the message names the path."""


def load_environment(path: str) -> Environment:
    """``package.module:Name`` -> an environment: ``Name`` is a class (made with no arguments) or an
    object with a ``step`` method. A bad path is an ``EnvironmentConfigError`` naming it."""
    obj, module_name, attr = import_named(path, what="environment", error=EnvironmentConfigError,
                                          shape="package.module:Name")
    if obj is None:
        raise EnvironmentConfigError(f"environment {path!r}: {module_name} has no {attr!r}")
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:  # its constructor is user code
            raise EnvironmentConfigError(f"environment {path!r}: {attr}() raised "
                                         f"{type(e).__name__}: {e}") from None
    if not callable(getattr(obj, "step", None)):
        raise EnvironmentConfigError(f"environment {path!r}: {attr} has no step(trajectory) method")
    return obj


class RewardEnvironment:
    """A single-turn task: its first step is ``Done(reward_fn(...))``, whatever the turn ended with."""

    def __init__(self, reward_fn: Callable[[RewardInput], float]):
        self.reward_fn = reward_fn

    def step(self, trajectory: Trajectory) -> Step:
        return Done(self.reward_fn(trajectory.reward_input()))


def checked(value: Any, *, where: str = "step") -> Step:
    """``value`` if it is a well-formed step, else ``BadStep`` naming what came back."""
    if isinstance(value, Done):
        r = value.reward
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
            raise BadStep(f"{where} returned Done({r!r:.60}): the reward must be a finite number")
        return Done(float(r))
    if isinstance(value, Continue):
        obs = value.observation
        if isinstance(obs, str):
            text = obs
        elif isinstance(obs, dict) and isinstance(obs.get("content"), str):
            if obs.get("role", "tool") != "tool":
                raise BadStep(f"{where} returned an observation of role {obs.get('role')!r}, not 'tool'")
            text = obs["content"]
        else:
            raise BadStep(f"{where} returned Continue({type(obs).__name__}): the observation must be a "
                          f"string or a message with a string 'content'")
        if "\x00" in text:
            raise BadStep(f"{where} returned an observation with a NUL character")
        if len(text) > MAX_OBSERVATION_CHARS:
            raise BadStep(f"{where} returned an observation of {len(text)} characters "
                          f"(at most {MAX_OBSERVATION_CHARS})")
        return value
    raise BadStep(f"{where} returned {type(value).__name__} {value!r:.60}, not Continue(...) or Done(...)")


class StepCache:
    """Each step's result by ``(sample_id, turn)``, so that a step the broker sends again is answered
    with what it returned the first time instead of running (and calling its tools) again. Bounded:
    the oldest results go first once ``capacity`` are kept (a repeat comes within
    ``score_timeout_s`` of the first run, long before that)."""

    def __init__(self, capacity: int = 65536):
        if capacity < 1:
            raise ValueError(f"StepCache capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._results: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.repeats = 0
        """Steps answered from the cache."""

    def get(self, sample_id: int, turn: int) -> Any | None:
        result = self._results.get((sample_id, turn))
        if result is not None:
            self.repeats += 1
            self._results.move_to_end((sample_id, turn))
        return result

    def put(self, sample_id: int, turn: int, result: Any) -> None:
        self._results[(sample_id, turn)] = result
        self._results.move_to_end((sample_id, turn))
        while len(self._results) > self.capacity:
            self._results.popitem(last=False)

    def forget(self, sample_id: int) -> None:
        """Drop every result of ``sample_id`` (its trajectory ended)."""
        for key in [k for k in self._results if k[0] == sample_id]:
            del self._results[key]

    def __len__(self) -> int:
        return len(self._results)
