"""Each cell against sync, paired over seeds: a ratio, its 95 % bootstrap interval and a verdict.

Every cell runs the same seeds (the same prompt streams), so a cell and sync are compared seed by
seed. For a claim (time and trained samples to a reward level, trained tokens/s, the held-out
reward at the window's end) the ratio is mean(cell) / mean(sync) over the seeds where both have a number; the interval
resamples those seeds with replacement, the cell's and sync's number of a seed together (a paired
bootstrap), and takes the 2.5th and 97.5th percentiles of the resampled ratios. The verdict says
which side of 1 the whole interval lies on, and "not distinguishable" when it straddles 1.

With few seeds the interval is coarse (3 seeds have 10 distinct resamples): it says what the runs
can separate, not more. Fewer than two paired seeds give no interval.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

LOWER_IS_BETTER = "lower"
HIGHER_IS_BETTER = "higher"


@dataclass(frozen=True)
class Interval:
    """A paired ratio cell / sync over ``pairs`` seeds, with its bootstrap interval ``[lo, hi]``."""

    ratio: float
    lo: float
    hi: float
    pairs: int


def paired_ratio(cell: dict[int, float], sync: dict[int, float], *, resamples: int = 10_000, level: float = 0.95,
                 seed: int = 0) -> Interval | None:
    """mean(cell) / mean(sync) over the seeds both have, and its percentile interval from
    ``resamples`` paired resamples of those seeds (a fixed ``seed``: the same numbers always give the
    same interval). None with fewer than two paired seeds or a sync mean of 0."""
    seeds = sorted(set(cell) & set(sync))
    if len(seeds) < 2:
        return None
    a, b = [cell[s] for s in seeds], [sync[s] for s in seeds]
    if statistics.fmean(b) == 0:
        return None
    rng = random.Random(seed)
    n = len(seeds)
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        den = sum(b[i] for i in pick)
        if den != 0:
            ratios.append(sum(a[i] for i in pick) / den)
    ratios.sort()
    tail = (1.0 - level) / 2
    at = lambda q: ratios[min(len(ratios) - 1, max(0, round(q * (len(ratios) - 1))))]  # noqa: E731
    return Interval(statistics.fmean(a) / statistics.fmean(b), at(tail), at(1.0 - tail), n)


def verdict(interval: Interval | None, better: str, words: tuple[str, str] = ("faster", "slower")) -> str:
    """``"<good> than sync"`` when the whole interval is on the good side of 1 (below it when
    ``better`` is ``"lower"``, above when ``"higher"``), ``"<bad> than sync"`` when it is all on the
    other side, else ``"not distinguishable"`` (also with no interval)."""
    if interval is None:
        return "not distinguishable"
    good, bad = words
    if interval.hi < 1.0:
        return f"{good if better == LOWER_IS_BETTER else bad} than sync"
    if interval.lo > 1.0:
        return f"{bad if better == LOWER_IS_BETTER else good} than sync"
    return "not distinguishable"


Claim = tuple[str, str, str, tuple[str, str]]
"""(run key, what it says, which way is better, verdict words)."""


def claims(levels: list[float], eval_levels: list[float], with_eval: bool) -> list[Claim]:
    """The claims compared with sync: (run key, what it says, which way is better, verdict words)."""
    fewer = ("fewer samples", "more samples")
    out = [(f"t_{lv:g}", f"time to batch reward {lv:g}", LOWER_IS_BETTER, ("faster", "slower")) for lv in levels]
    out += [(f"s_{lv:g}", f"samples to batch reward {lv:g}", LOWER_IS_BETTER, fewer) for lv in levels]
    out.append(("tokens_per_s", "trained tokens/s", HIGHER_IS_BETTER, ("faster", "slower")))
    out += [(f"te_{lv:g}", f"time to held-out reward {lv:g}", LOWER_IS_BETTER, ("faster", "slower"))
            for lv in eval_levels]
    out += [(f"se_{lv:g}", f"samples to held-out reward {lv:g}", LOWER_IS_BETTER, fewer) for lv in eval_levels]
    if with_eval:
        out.append(("eval_final", "held-out reward at the end", HIGHER_IS_BETTER, ("higher", "lower")))
    return out


def against_sync(cells: list[str], runs: list[dict], levels: list[float], eval_levels: list[float] = ()) -> list[dict]:
    """Every claim of every cell but sync, paired with sync's runs of the same seed: rows of
    ``cell``, ``claim``, ``key``, ``ratio``, ``lo``, ``hi``, ``pairs`` and ``verdict``."""
    ok = [r for r in runs if r.get("status") == "ok"]

    def by_seed(cell: str, key: str) -> dict[int, float]:
        return {r["seed"]: float(r[key]) for r in ok if r["cell"] == cell and r.get(key) is not None}

    rows = []
    with_eval = any(r.get("eval_final") is not None for r in ok)
    for cell in cells:
        if cell == "sync":
            continue
        for key, claim, better, words in claims(levels, list(eval_levels), with_eval):
            iv = paired_ratio(by_seed(cell, key), by_seed("sync", key))
            rows.append({"cell": cell, "claim": claim, "key": key, "ratio": iv and iv.ratio, "lo": iv and iv.lo,
                         "hi": iv and iv.hi, "pairs": iv.pairs if iv else len(set(by_seed(cell, key)) & set(
                             by_seed("sync", key))), "verdict": verdict(iv, better, words)})
    return rows
