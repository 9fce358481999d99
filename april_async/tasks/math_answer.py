r"""Math answers: find the final answer of a response, normalise it, compare it with the gold one.

Two answer forms are recognised, and the one that comes last in the text wins:

- GSM8K's ``#### 42``: the text after the last ``####``, to the end of its line;
- LaTeX's ``\boxed{42}`` (also ``\fbox{...}``): the contents of the last box, nested braces
  included (``\boxed{\frac{1}{2}}``).

Normalisation removes whitespace, ``$`` signs, ``\text{...}`` wrappers, LaTeX spacing, thousands
separators (``1,234`` and ``1{,}234``), a trailing ``.``, and a trailing ``%``. Two answers that
both read as numbers (integers, decimals, ``a/b``, ``\frac{a}{b}``) are compared exactly as
fractions, so ``42.0`` matches ``42`` and ``0.5`` matches ``\frac{1}{2}``; anything else is
compared as normalised text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_HASHES = "####"
_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")  # \frac12


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` (not yet normalised), or None when it states none."""
    candidates = []  # (position, answer)
    at = text.rfind(_HASHES)
    if at >= 0:
        line = text[at + len(_HASHES):].split("\n", 1)[0].strip()
        if line:
            candidates.append((at, line))
    boxed = _last_box(text)
    if boxed is not None:
        candidates.append(boxed)
    return max(candidates)[1] if candidates else None


def _last_box(text: str) -> tuple[int, str] | None:
    """(position, contents) of the last closed ``\\boxed{...}``/``\\fbox{...}``."""
    starts = sorted(((text.rfind(o), o) for o in _BOX_OPENERS), reverse=True)
    for start, opener in starts:
        while start >= 0:
            depth, i = 1, start + len(opener)
            while i < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            if depth == 0:
                return start, text[start + len(opener):i - 1].strip()
            start = text.rfind(opener, 0, start)  # unclosed: try the one before
    return None


def normalize(answer: str) -> str:
    """A canonical text form of an answer (see the module docstring)."""
    s = str(answer).strip()
    s = _TEXT_WRAPPER.sub(r"\1", s)
    for junk in ("$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "{,}"):
        s = s.replace(junk, "," if junk == "{,}" else "")
    s = s.replace("\\%", "%").strip()
    s = s.rstrip(".").rstrip()
    if s.endswith("%"):
        s = s[:-1].rstrip()
    s = _THOUSANDS.sub("", s)
    return "".join(s.split())


def parse_number(answer: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number, else None."""
    s = answer
    m = _FRAC.match(s) or _FRAC_SHORT.match(s)
    if m:
        num, den = parse_number(m.group(2)), parse_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) else num / den
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, gold: str | int | float) -> bool:
    """Whether ``predicted`` (as extracted) states ``gold``."""
    if predicted is None:
        return False
    p, g = normalize(predicted), normalize(str(gold))
    pn, gn = parse_number(p), parse_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return p == g


def score(response_text: str, answer: str | int | float) -> float:
    """1.0 when the response's final answer matches ``answer``, else 0.0."""
    return 1.0 if answers_match(extract_answer(response_text), answer) else 0.0


def final_answer_reward(trajectory) -> float:
    """The reward of a conversation (an ``agents.env.Trajectory``): its last turn's final answer
    against ``meta["answer"]`` (``score``); a ``KeyError`` naming the task where meta has none."""
    if "answer" not in trajectory.meta:
        raise KeyError(f"task {trajectory.task!r}: meta has no 'answer' (keys: {sorted(trajectory.meta)})")
    return score(trajectory.last_text, trajectory.meta["answer"])
