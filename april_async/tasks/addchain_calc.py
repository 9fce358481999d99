"""``addchain`` with a calculator: the environment of the tool-using addition chains (issue 45).

The policy may hand part of a chain to a tool. A turn that ends in a call, its last line::

    calc{17+8x3}

is answered with the observation ``= 41`` on a line of its own and the conversation goes on; a
turn that writes the final answer (``#### 57``) ends it, with the math-answer reward of that
answer. So a model can write ``calc{17+8x5}``, read ``= 57`` and answer ``#### 57`` in two turns
instead of five lines.
Braces, not parentheses: the character tokenizer has both, the answer's lines use ``)`` (``5)
17+8=25``) and never ``}``, so ``}`` can end a turn as a stop token of the lease.

The calculator reads the task's own notation and nothing else: a sum of terms, each a whole number
or ``NxK`` (N added K times), e.g. ``17+8x5`` or ``25+8+8``. Anything else is answered with a
typed error as the observation (``error bad expression``: the words of the character tokenizer's
alphabet, which has no ``:`` or ``_``), not a crash: the policy sees it
and may try again. A turn that neither calls nor answers, a turn cut by its budget, and the turn at
the limit (``meta["max_turns"]``, else ``MAX_TURNS``, or the broker's: ``Trajectory.last_turn``) end
the conversation with the reward of what the last turn answered (0 when nothing).

The task (``TASK``: ``prompts = { kind = "addchain", task = "addchain_calc" }``) is ``addchain``'s
problems under another name, so that the scorer steps this environment for them. Its warm start
(``tool_reference``) shows the call on half of the problems (a stable hash picks which) and the
worked lines on the others: the initial policy calls the tool on about half of its answers, and
reinforcement learning has the choice to learn, since only the call is right on every long chain.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from april_async.agents.env import Continue, Done, Step, Trajectory
from april_async.tasks import math_answer
from april_async.tasks.base import Problem

TASK = "addchain_calc"
BAD_EXPRESSION = "error bad expression"
"""The observation of a call the calculator does not read (``CalcError`` says why, to a caller)."""
MAX_TURNS = 8
TOOL_SHARE_BUCKETS = 2
"""A problem's warm-start reference calls the tool when the hash of its prompt falls in bucket 0
of this many (one in two)."""
MAX_DIGITS = 12
"""The longest number the calculator reads (a larger one is a ``bad_expression``)."""
_CALL = re.compile(r"calc\{([^{}\n]*)\}\s*$")


class CalcError(ValueError):
    """An expression the calculator does not read; the message says why."""


def evaluate(expression: str) -> int:
    """``"17+8x5"`` -> 57. A sum of whole numbers and ``NxK`` terms; ``CalcError`` otherwise."""
    text = expression.replace(" ", "")
    if not text:
        raise CalcError("empty expression")
    total = 0
    for term in text.split("+"):
        parts = term.split("x")
        if len(parts) > 2 or not all(p.isdigit() for p in parts):
            raise CalcError(f"{term!r} is not a number or NxK")
        if any(len(p) > MAX_DIGITS for p in parts):
            raise CalcError(f"{term!r} has a number of more than {MAX_DIGITS} digits")
        total += int(parts[0]) * (int(parts[1]) if len(parts) == 2 else 1)
    return total


def call_in(text: str) -> str | None:
    """The expression of the call that ends ``text`` (its last line is ``calc{...}``), or None."""
    match = _CALL.search(text)
    return match.group(1) if match else None


class CalcEnvironment:
    """The environment of ``addchain`` with the calculator tool (see the module docstring)."""

    def __init__(self, max_turns: int = MAX_TURNS):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, not {max_turns}")
        self.max_turns = max_turns

    def step(self, trajectory: Trajectory) -> Step:
        text = trajectory.last_text
        limit = int(trajectory.meta.get("max_turns", self.max_turns))
        expression = call_in(text)
        calls_on = (expression is not None and math_answer.extract_answer(text) is None
                    and trajectory.finish_reason == "stop" and trajectory.turn + 1 < limit
                    and not trajectory.last_turn)
        if not calls_on:
            return Done(math_answer.final_answer_reward(trajectory))
        try:
            return Continue(f"\n= {evaluate(expression)}\n")
        except CalcError:
            return Continue(f"\n{BAD_EXPRESSION}\n")



def uses_tool(prompt: str) -> bool:
    """Whether the warm start's reference for ``prompt`` calls the calculator (a stable hash, not
    Python's salted one: one problem in ``TOOL_SHARE_BUCKETS``)."""
    digest = hashlib.blake2b(f"calc:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % TOOL_SHARE_BUCKETS == 0


def tool_reference(problem: Problem) -> Problem:
    """``problem`` (an ``addchain`` one) as this task's: renamed ``TASK``, and, where ``uses_tool``, its
    reference the conversation ``calc{17+8x5}`` / ``= 57`` / ``#### 57`` (the observation exactly
    as ``CalcEnvironment`` answers); elsewhere its worked lines."""
    problem = replace(problem, task=TASK)
    chain = problem.prompt.strip()
    if not uses_tool(chain):
        return problem
    answer = problem.meta["answer"]
    turns = (f"calc{{{chain}}}", f"\n= {evaluate(chain)}\n", f"#### {answer}")
    return replace(problem, reference="".join(turns), reference_turns=turns)
