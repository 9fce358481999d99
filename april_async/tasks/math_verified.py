r"""Math answers checked with Hugging Face's ``math-verify`` (``parse`` + ``verify``), as TRL and open-r1 do.

- The gold answer is the text a data set gives (``datasets.py`` has already taken GSM8K's ``#### 72``
  or a ``\boxed{72}`` out of a worked solution). Text that still holds a ``####`` is cut to what
  follows the last one, as math-verify's own GSM8K task does. It is then parsed as the contents of a
  ``\boxed{}`` (LaTeX first, then plain expressions), the way math-verify's MATH tasks read gold
  answers, so ``72``, ``1,234``, ``0.5``, ``\frac{1}{2}``, ``\{1,2\}``, ``[1,2)`` and ``x=3`` all read as
  mathematics. A gold answer that does not parse is the data set's fault: ``GoldAnswerError``.
- The response is parsed with math-verify's default extraction (LaTeX, ``\boxed{}`` first, then plain
  expressions: GSM8K's ``#### 72`` and "the answer is 72" both read as 72; the last answer stated wins).
  A response in which it finds nothing is *unparsed*: ``score`` returns None.
- ``verify(gold, response)`` compares them: symbolic equality, numbers to 6 decimal places, sets,
  intervals, equations (``x=3`` states 3), matrices.

**Timeouts.** math-verify bounds each parse and each comparison with ``signal.alarm``, which works
only in a process's main thread (elsewhere it raises ValueError). The scorer calls rewards in the
main thread of its worker process (``scorer/worker.py``), so there the limits hold:
``PARSE_TIMEOUT_S`` per parse and ``VERIFY_TIMEOUT_S`` per comparison; a call's worst case,
``WORST_CASE_S``, is kept under the scorer's default ``timeout_s``, so a pathological answer scores 0
and the worker is kept, rather than being killed as a ``reward_timeout``. A parse that runs out of
time finds nothing (unparsed); a comparison that does is False. In any other thread the limits are
off (math-verify's own advice) and the caller bounds the time, as the scorer's kill does.
"""

from __future__ import annotations

import functools
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

PARSE_TIMEOUT_S = 1
"""math-verify's limit on one parse (whole seconds: it is ``signal.alarm``'s); parsing an answer takes
milliseconds."""
VERIFY_TIMEOUT_S = 1
"""math-verify's limit on one comparison (whole seconds)."""
WORST_CASE_S = 2 * PARSE_TIMEOUT_S + VERIFY_TIMEOUT_S
"""One call, every limit reached: the gold's parse (once per gold: cached), the response's, and one
symbolic comparison (``parse`` returns one expression and its text; text against an expression is
False at once)."""
GOLD_CACHE_SIZE = 4096
"""Gold answers kept parsed: every sample of a group, and every epoch, asks again."""

_GOLD_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class GoldAnswerError(ValueError):
    """A gold answer math-verify finds nothing in; the message names it."""


def score(response_text: str, answer: str | int | float) -> float | None:
    """1.0 when the response states the gold ``answer``, 0.0 when it states another, None when
    math-verify finds no answer in it (or ran out of time looking)."""
    parse_s, verify_s = _timeouts()
    gold = list(_parse_gold(str(answer), parse_s))
    stated = parse(response_text, parsing_timeout=parse_s)
    if not stated:
        return None
    return 1.0 if verify(gold, stated, timeout_seconds=verify_s) else 0.0


def gold_text(answer: str) -> str:
    """The gold answer's own text: what follows the last ``####``, if there is one."""
    return answer.rsplit("####", 1)[-1].strip()


@functools.lru_cache(maxsize=GOLD_CACHE_SIZE)
def _parse_gold(answer: str, parse_s: int | None) -> tuple:
    text = gold_text(answer)
    parsed = parse(f"\\boxed{{{text}}}", _GOLD_EXTRACTION, extraction_mode="first_match",
                   parsing_timeout=parse_s) if text else []
    if not parsed:
        raise GoldAnswerError(f"gold answer {answer!r:.200}: math-verify reads no answer in it")
    return tuple(parsed)  # verify() takes a list: the caller copies it out


def _timeouts() -> tuple[int | None, int | None]:
    """(parse, verify) limits for math-verify: ours in a main thread, none elsewhere (see above)."""
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S
    return None, None
