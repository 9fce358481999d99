"""``addchain``: the built-in synthetic task, repeated addition with a long tail of lengths.

A problem ``17+8x5`` asks for 17 with 8 added five times. The worked answer writes one line per
addition, each with a countdown of the additions left, and ends GSM8K-style::

    17+8x5            (prompt, then a newline)
    5) 17+8=25
    4) 25+8=33
    3) 33+8=41
    2) 41+8=49
    1) 49+8=57
    #### 57

Why this shape:

- **Verifiable.** The answer is ``start + steps * add``, checked from the text by the math-answer
  reward (``#### 57``). It spans 3..234, so skipping the work and guessing does not pay.
- **Long-tailed lengths** (the workload APRIL exists for): the number of additions is drawn
  with P(k) ∝ k^-1.3 for k = 1..15, so most answers are one or two lines and a few are fifteen.
  Measured over 20,000 problems (``length_stats()``), response tokens with the character
  tokenizer, end-of-sequence included: **median 30, p90 111, p99 189, max 209** (mean 48);
  p99 is 6× the median.
- **Locally easy.** Each line copies the previous result and the (fixed) addend, adds a single
  digit, and counts down by one; the last line is followed by the answer. A two-layer,
  0.4M-parameter decoder with the character tokenizer learns it in about a minute on one core
  (``warmstart/sft.py``); sampled at temperature 1 it then errs on a few lines in a long
  chain, which leaves reinforcement learning a clear margin to climb. (Starts up to 9,000, which
  made 1,080,000 problems, were tried on 2026-11-26 and undone the same day: copying four-digit
  numbers took the README's main job from a warm start at 0.48 held-out reward in 93 s to one at
  0.008 after its whole 300 s budget, and the run no longer learned within its 10 minutes.)

- **A held-out set held out by construction.** 15 lengths × 8 addends × 99 starts make 11,880
  distinct problems; those whose hash falls in one bucket of ``HELD_OUT_BUCKETS`` (1/6: 1,981
  problems, ``HELD_OUT_SIZE``) are the held-out partition (``is_held_out``). A training stream
  (``make_problem``, every seed: the broker's and the warm start's) never yields one of them: it
  draws again; the held-out stream (``held_out_problem``) yields only them. So no run trains on a
  problem it is evaluated on, whatever the seeds; an evaluation set is drawn from it without
  repeats (``warmstart.sft.held_out_problems``), at most ``HELD_OUT_SIZE`` problems.

**Long chains** (``chains = "long"``: the broker's ``prompts.chains``): the same problems with up
to 100 additions (``LONG_MAX_STEPS``) and the same tail, P(k) ∝ k^-1.3 for k = 1..100, so that a
response can run past 1,024 tokens while most stay short: the workload where a synchronous step
waits on its longest few (APRIL's setting) and a learner, which trains on the mean, is a small
share of it. Results stay below 1,000 (99 + 100 × 9 = 999), so a line is never harder than the
short family's (three-digit sums with a carry already occur there). Measured over 20,000 problems
(``length_stats(chains="long")``): **median 41, p90 459, p99 1215, max 1398** (mean 151); p99 is
30× the median, and the longest answer of all is 1,400 tokens. Its held-out partition is the same hash's bucket 0 over its own 79,200 problems
(13,262: ``held_out_size("long")``), so a problem is held out in both families or in neither, and
no training stream of either family draws a problem either holds out. The long stream draws from
its own seeds (``addchain-long:<seed>:<index>``), apart from the short family's.

Deterministic: problem ``index`` of stream ``seed`` is a pure function of the two, so a stream can
be resumed at any index without replaying it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
from collections.abc import Iterator
from typing import Literal

from april_async.tasks.base import Problem

TASK = "addchain"
Chains = Literal["short", "long"]
"""The family of chain lengths: ``short`` (up to ``MAX_STEPS`` additions) or ``long`` (``LONG_MAX_STEPS``)."""
MAX_STEPS = 15
"""The most additions in one problem (the longest answer fits ~240 character tokens)."""
LONG_MAX_STEPS = 100
"""The most additions in one problem of the long family (the longest answer: 1,400 tokens)."""
TAIL_EXPONENT = 1.3
"""P(steps = k) ∝ k^-TAIL_EXPONENT: the smaller, the heavier the tail."""
START_RANGE = (1, 99)
ADD_RANGE = (2, 9)
HELD_OUT_BUCKETS = 6
"""A problem is held out when the hash of its prompt falls in bucket 0 of this many."""
SPACE = MAX_STEPS * (ADD_RANGE[1] - ADD_RANGE[0] + 1) * (START_RANGE[1] - START_RANGE[0] + 1)
"""Distinct problems: 11,880 (the long family: ``LONG_MAX_STEPS / MAX_STEPS`` times as many, 79,200)."""



def max_steps(chains: Chains = "short") -> int:
    """The most additions in one problem of the family ``chains``."""
    return {"short": MAX_STEPS, "long": LONG_MAX_STEPS}[chains]


@functools.cache
def _cum_weights(chains: Chains) -> list[float]:
    return list(itertools.accumulate(k**-TAIL_EXPONENT for k in range(1, max_steps(chains) + 1)))


@functools.cache
def held_out_size(chains: Chains = "short") -> int:
    """Problems in the held-out partition of the family ``chains`` (1,981 short, 13,262 long)."""
    return sum(is_held_out(start, add, steps) for start in range(START_RANGE[0], START_RANGE[1] + 1)
               for add in range(ADD_RANGE[0], ADD_RANGE[1] + 1) for steps in range(1, max_steps(chains) + 1))


def worked_answer(start: int, add: int, steps: int) -> str:
    """The reference response: one line per addition, then ``#### <result>``."""
    lines, x = [], start
    for left in range(steps, 0, -1):
        lines.append(f"{left}) {x}+{add}={x + add}\n")
        x += add
    return "".join(lines) + f"#### {x}"


def is_held_out(start: int, add: int, steps: int) -> bool:
    """Whether the problem ``start+add x steps`` is in the held-out partition (a stable hash of its
    prompt, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{start}+{add}x{steps}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELD_OUT_BUCKETS == 0


HELD_OUT_SIZE = held_out_size()
"""Problems in the held-out partition: 1,981."""


def _draw(rng: random.Random, held_out: bool, chains: Chains = "short") -> tuple[int, int, int]:
    """(start, add, steps) from ``rng``, drawn again until it is in the partition asked for."""
    weights, most = _cum_weights(chains), max_steps(chains)
    while True:
        steps = rng.choices(range(1, most + 1), cum_weights=weights)[0]
        add = rng.randint(*ADD_RANGE)
        start = rng.randint(*START_RANGE)
        if is_held_out(start, add, steps) == held_out:
            return start, add, steps


def _problem(prompt_id: str, start: int, add: int, steps: int) -> Problem:
    return Problem(prompt_id=prompt_id, prompt=f"{start}+{add}x{steps}\n", task=TASK,
                   meta={"answer": str(start + steps * add), "start": start, "add": add, "steps": steps},
                   reference=worked_answer(start, add, steps))


def _stream(chains: Chains) -> str:
    """The name that seeds a family's streams and prefixes its prompt ids (the short family's is the task's)."""
    return TASK if chains == "short" else f"{TASK}-{chains}"


def make_problem(seed: int, index: int, chains: Chains = "short") -> Problem:
    """Problem ``index`` of the training stream ``seed``: never one of the held-out partition."""
    name = _stream(chains)
    rng = random.Random(f"{name}:{seed}:{index}")  # a str seed is hashed with SHA-512: stable across runs
    return _problem(f"{name}-{seed}-{index}", *_draw(rng, False, chains))


def held_out_problem(seed: int, index: int, chains: Chains = "short") -> Problem:
    """Problem ``index`` of the held-out stream ``seed``: only problems of the held-out partition,
    with the training streams' distribution of lengths, addends and starts."""
    name = _stream(chains)
    rng = random.Random(f"{name}:held-out:{seed}:{index}")
    return _problem(f"{name}-held-out-{seed}-{index}", *_draw(rng, True, chains))


def problems(seed: int = 0, start: int = 0, *, held_out: bool = False, chains: Chains = "short") -> Iterator[Problem]:
    """The endless training stream ``seed`` (or, with ``held_out``, the held-out one), from
    problem ``start`` on."""
    make = held_out_problem if held_out else make_problem
    for index in itertools.count(start):
        yield make(seed, index, chains)


def length_stats(n: int = 20_000, seed: int = 0, *, chains: Chains = "short") -> dict[str, float]:
    """Response length in character tokens (end-of-sequence included) over ``n`` problems."""
    lengths = sorted(len(p.reference) + 1 for p in itertools.islice(problems(seed, chains=chains), n))
    at = lambda q: lengths[min(n - 1, int(q * n))]  # noqa: E731
    return {"median": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": lengths[-1], "mean": sum(lengths) / n}
