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
  tokenizer, end-of-sequence included: **median 30, p90 113, p99 189, max 209** (mean 49);
  p99 is 6× the median.
- **Locally easy.** Each line copies the previous result and the (fixed) addend, adds a single
  digit, and counts down by one; the last line is followed by the answer. A two-layer,
  0.4M-parameter decoder with the character tokenizer learns it in about a minute on one core
  (``warmstart/sft.py``); sampled at temperature 1 it then errs on a few lines in a long
  chain, which leaves reinforcement learning a clear margin to climb.

Deterministic: problem ``index`` of stream ``seed`` is a pure function of the two, so a stream can
be resumed at any index without replaying it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from april_async.tasks.base import Problem

TASK = "addchain"
MAX_STEPS = 15
"""The most additions in one problem (the longest answer fits ~200 character tokens)."""
TAIL_EXPONENT = 1.3
"""P(steps = k) ∝ k^-TAIL_EXPONENT: the smaller, the heavier the tail."""
START_RANGE = (1, 99)
ADD_RANGE = (2, 9)

_CUM_WEIGHTS = list(itertools.accumulate(k**-TAIL_EXPONENT for k in range(1, MAX_STEPS + 1)))


def worked_answer(start: int, add: int, steps: int) -> str:
    """The reference response: one line per addition, then ``#### <result>``."""
    lines, x = [], start
    for left in range(steps, 0, -1):
        lines.append(f"{left}) {x}+{add}={x + add}\n")
        x += add
    return "".join(lines) + f"#### {x}"


def make_problem(seed: int, index: int) -> Problem:
    """Problem ``index`` of stream ``seed``."""
    rng = random.Random(f"{TASK}:{seed}:{index}")  # a str seed is hashed with SHA-512: stable across runs
    steps = rng.choices(range(1, MAX_STEPS + 1), cum_weights=_CUM_WEIGHTS)[0]
    add = rng.randint(*ADD_RANGE)
    start = rng.randint(*START_RANGE)
    answer = start + steps * add
    return Problem(prompt_id=f"{TASK}-{seed}-{index}", prompt=f"{start}+{add}x{steps}\n", task=TASK,
                   meta={"answer": str(answer), "start": start, "add": add, "steps": steps},
                   reference=worked_answer(start, add, steps))


def problems(seed: int = 0, start: int = 0) -> Iterator[Problem]:
    """The endless stream ``seed``, from problem ``start`` on."""
    for index in itertools.count(start):
        yield make_problem(seed, index)


def length_stats(n: int = 20_000, seed: int = 0) -> dict[str, float]:
    """Response length in character tokens (end-of-sequence included) over ``n`` problems."""
    lengths = sorted(len(p.reference) + 1 for p in itertools.islice(problems(seed), n))
    at = lambda q: lengths[min(n - 1, int(q * n))]  # noqa: E731
    return {"median": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": lengths[-1], "mean": sum(lengths) / n}
