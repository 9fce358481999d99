"""Each cell against sync, paired over seeds: a ratio, its interval, and a verdict (issue 43).

Every cell runs the same seeds (the same prompt streams), so a cell and sync are compared seed by
seed. For a claim (trained tokens/s, the held-out reward at the window's end, the time or samples to
a reward level), each seed gives the log of its ratio cell / sync; the **ratio** is the exponential of
their mean (the geometric mean of the per-seed ratios), and its interval is the **paired t-interval
on those logs**, exponentiated: ``mean ± t(n−1) · sd / √n``.

Why this one. Per-seed numbers of a run are positive and their spread multiplicative (a slow seed is
slow in every cell), so the log-ratio is the natural scale, and over log-normal seeds the interval is
exact: it covers the true ratio 95 % of the time at any number of pairs. The paired percentile
bootstrap of the ratio of means it replaces covered 86–90 % at 8 pairs and 78–80 % at 4 (the
coverage test, ``tests/unit/test_experiment_paired.py``, measures both); with n seeds a bootstrap
has at most n^n resamples and its tails are too short. A sign-flip permutation test is exact too,
but at 4 pairs its finest interval is [min, max] of the logs, 87.5 %: it cannot reach 95 %.

**Censored times.** A time (or number of samples) to a level that a seed never reached within the
window is not dropped, which would flatter the cell that failed: it is *censored at the window's
end* (``censor_at``), the least it could have been, and counted. The row says "reached k of n".
Its log-ratio is then a bound, not a value, and the interval is valid in one direction only: a
censored *cell* time is too small, so the interval can only understate how much slower the cell is.
A verdict against the cell ("slower") stands; a verdict for it is withheld. A censored *sync* time
works the other way. A seed where neither side reached the level says nothing about their
difference: it is left out of the interval, and the row counts it. This is substitution at the
censoring time with a one-sided reading; with so few seeds, a survival model (Kaplan–Meier per
cell, a stratified log-rank) would only add assumptions.

**No verdict from fewer than ``MIN_PAIRS`` pairs.** With 3 pairs the t quantile is 4.3 and the
interval is wide, which is right; with 2 it is 12.7. Such a row shows the ratio and says why it
gives no verdict. A row with no pair says "no data".

**Many claims.** An experiment names its primary claims before it runs (``[experiment] primary``:
claims of ``primary_cell`` against sync). Their intervals are Bonferroni's: each at level
1 − 0.05/k for k primary claims, so that all hold together at 95 %. Every other row is labelled
exploratory, at an unadjusted 95 %.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LOWER_IS_BETTER = "lower"
HIGHER_IS_BETTER = "higher"
LEVEL = 0.95
MIN_PAIRS = 4
"""The fewest pairs a verdict is given from."""


# ------------------------------------------------------ Student's t, for whole degrees of freedom


def t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with ``df`` (a whole number ≥ 1) degrees of freedom, from the closed
    forms for whole ``df`` in θ = atan(t / √df): a finite sum of powers of cos θ."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a whole number >= 1, got {df!r}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2/π)[θ + sin θ cos θ (1 + 2/3 cos² θ + (2·4)/(3·5) cos⁴ θ + ...)]
        term, acc = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        a = 2 / math.pi * (theta + s * math.cos(theta) * acc)
    else:  # even: sin θ (1 + 1/2 cos² θ + (1·3)/(2·4) cos⁴ θ + ...)
        term, acc = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        a = s * acc
    return 0.5 + math.copysign(a, t) / 2


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``, to
    1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    while hi - lo > 1e-10 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


# ---------------------------------------------------------------------- one claim


@dataclass(frozen=True)
class Interval:
    """A paired ratio cell / sync: the geometric mean of the per-seed ratios over ``pairs`` seeds,
    its interval ``[lo, hi]`` at ``level`` (None with fewer than ``MIN_PAIRS`` pairs, or none), and the
    seeds censored on each side (see the module docstring)."""

    ratio: float | None
    lo: float | None
    hi: float | None
    pairs: int
    level: float = LEVEL
    censored_cell: int = 0  # pairs whose cell value is the window's end (the level never reached)
    censored_sync: int = 0
    neither: int = 0  # seeds where neither reached the level: not in the pairs
    seeds: int = 0  # seeds both ran (pairs + neither)


def paired_interval(cell: dict[int, float | None], sync: dict[int, float | None], *, level: float = LEVEL,
                    censor_at: dict[int, tuple[float, float]] | None = None) -> Interval:
    """The paired t-interval on log(cell / sync) over the seeds both have. A value of None is a level
    never reached: with ``censor_at`` (seed -> the window's end for the cell and for sync, in the
    claim's unit) it is censored there; without, the seed is left out (no data). A seed with a value
    of 0 (a level reached at once) has no ratio and is left out too."""
    seeds = sorted(set(cell) & set(sync))
    logs: list[float] = []
    cc = cs = neither = 0
    for s in seeds:
        c, y = cell[s], sync[s]
        if c is None and y is None:
            neither += censor_at is not None
            continue
        if (c is None or y is None) and (censor_at is None or s not in censor_at):
            continue
        if c is None:
            c, cc = censor_at[s][0], cc + 1
        if y is None:
            y, cs = censor_at[s][1], cs + 1
        if c <= 0 or y <= 0:  # a level reached at once (0 s, 0 samples): no ratio, left out
            cc, cs = cc - (cell[s] is None), cs - (sync[s] is None)
            continue
        logs.append(math.log(c) - math.log(y))
    n = len(logs)
    base = dict(pairs=n, level=level, censored_cell=cc, censored_sync=cs, neither=neither, seeds=n + neither)
    if n == 0:
        return Interval(None, None, None, **base)
    mean = statistics.fmean(logs)
    if n < MIN_PAIRS:
        return Interval(math.exp(mean), None, None, **base)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), **base)


def verdict(iv: Interval | None, better: str, words: tuple[str, str] = ("faster", "slower")) -> str:
    """``"<good> than sync"`` when the whole interval is on the good side of 1 (below it when
    ``better`` is ``"lower"``, above when ``"higher"``), ``"<bad> than sync"`` when all on the other
    side, else ``"not distinguishable"``. No verdict from fewer than ``MIN_PAIRS`` pairs, and none in
    the direction that censored seeds flatter (see the module docstring)."""
    if iv is None or iv.pairs == 0:
        return "no data"
    if iv.lo is None:
        return f"no verdict: {iv.pairs} pair{'s' if iv.pairs != 1 else ''} (at least {MIN_PAIRS})"
    good, bad = words
    below, above = iv.hi < 1.0, iv.lo > 1.0
    # A censored cell value is too small (its ratio too low); a censored sync value too large.
    if below and iv.censored_cell:
        return f"not distinguishable ({iv.censored_cell} censored " \
               f"seed{'s' if iv.censored_cell > 1 else ''} of the cell flatter it)"
    if above and iv.censored_sync:
        return f"not distinguishable ({iv.censored_sync} censored " \
               f"seed{'s' if iv.censored_sync > 1 else ''} of sync flatter it)"
    if below:
        return f"{good if better == LOWER_IS_BETTER else bad} than sync"
    if above:
        return f"{bad if better == LOWER_IS_BETTER else good} than sync"
    return "not distinguishable"


# ---------------------------------------------------------------------- every claim of every cell

Claim = tuple[str, str, str, tuple[str, str]]
"""(run key, what it says, which way is better, verdict words)."""

CENSORED_BY = {"t": "time", "te": "time", "s": "samples", "se": "samples"}
"""Claims that are a time or a number of samples to a level, by key prefix, and what censors them."""


RUN_CLAIMS: list[Claim] = [
    ("gen_tokens_per_s", "rollout tokens/s", HIGHER_IS_BETTER, ("faster", "slower")),
    ("sample_p99_s", "p99 trajectory time (admission to reward)", LOWER_IS_BETTER, ("shorter", "longer")),
]
"""Claims made only where the runs measured them (a run before issue 45 has no ``sample_p99_s``)."""


def claims(levels: list[float], eval_levels: list[float], with_eval: bool,
           measured: frozenset[str] = frozenset()) -> list[Claim]:
    """The claims compared with sync: (run key, what it says, which way is better, verdict words);
    those of ``RUN_CLAIMS`` for the keys in ``measured``."""
    fewer = ("fewer samples", "more samples")
    out = [(f"t_{lv:g}", f"time to batch reward {lv:g}", LOWER_IS_BETTER, ("faster", "slower"))
           for lv in levels]
    out += [(f"s_{lv:g}", f"samples to batch reward {lv:g}", LOWER_IS_BETTER, fewer) for lv in levels]
    out.append(("tokens_per_s", "trained tokens/s", HIGHER_IS_BETTER, ("faster", "slower")))
    out += [(f"te_{lv:g}", f"time to held-out reward {lv:g}", LOWER_IS_BETTER, ("faster", "slower"))
            for lv in eval_levels]
    out += [(f"se_{lv:g}", f"samples to held-out reward {lv:g}", LOWER_IS_BETTER, fewer)
            for lv in eval_levels]
    if with_eval:
        out.append(("eval_final", "held-out reward at the end", HIGHER_IS_BETTER, ("higher", "lower")))
    out += [c for c in RUN_CLAIMS if c[0] in measured]
    return out


def against_sync(cells: list[str], runs: list[dict], levels: list[float], eval_levels: list[float] = (), *,
                 window_s: float | None = None, primary: dict[str, list[str]] | None = None) -> list[dict]:
    """Every claim of every cell but sync, paired with sync's runs of the same seed: rows of ``cell``,
    ``claim``, ``key``, ``ratio``, ``lo``, ``hi``, ``level``, ``pairs``, ``reached`` ([cell, sync] seeds
    that reached a level, of ``seeds``), ``family`` (``primary`` or ``exploratory``) and ``verdict``.
    ``window_s``: the runs' window, where an unreached time is censored (an unreached number of
    samples is censored at the run's ``samples``); None: unreached seeds are left out. ``primary``:
    cell -> its primary claim keys (``[experiment] primary``), Bonferroni-adjusted over all of them."""
    ok = [r for r in runs if r.get("status") == "ok"]
    primary = primary or {}
    k = sum(len(v) for v in primary.values())

    def by_seed(cell: str, key: str) -> dict[int, float | None]:
        return {r["seed"]: (None if r.get(key) is None else float(r[key])) for r in ok if r["cell"] == cell
                and (r.get(key) is not None or key.split("_", 1)[0] in CENSORED_BY)}

    def censors(cell: str, key: str) -> dict[int, tuple[float, float]] | None:
        what = CENSORED_BY.get(key.split("_", 1)[0])
        if what is None or (what == "time" and window_s is None):
            return None
        if what == "time":
            return {r["seed"]: (window_s, window_s) for r in ok if r["cell"] == cell}
        mine = {r["seed"]: r.get("samples") for r in ok if r["cell"] == cell}
        theirs = {r["seed"]: r.get("samples") for r in ok if r["cell"] == "sync"}
        return {s: (mine[s], theirs[s]) for s in mine if mine[s] and theirs.get(s)}

    rows = []
    with_eval = any(r.get("eval_final") is not None for r in ok)
    for cell in cells:
        if cell == "sync":
            continue
        measured = frozenset(c[0] for c in RUN_CLAIMS if all(r.get(c[0]) is not None for r in ok))
        for key, claim, better, words in claims(levels, list(eval_levels), with_eval, measured):
            is_primary = key in primary.get(cell, ())
            level = 1 - (1 - LEVEL) / k if is_primary else LEVEL
            mine, theirs = by_seed(cell, key), by_seed("sync", key)
            iv = paired_interval(mine, theirs, level=level, censor_at=censors(cell, key))
            both = sorted(set(mine) & set(theirs))
            rows.append({"cell": cell, "claim": claim, "key": key, "ratio": iv.ratio, "lo": iv.lo,
                         "hi": iv.hi, "level": level, "pairs": iv.pairs, "seeds": len(both),
                         "reached": [sum(mine[s] is not None for s in both),
                                     sum(theirs[s] is not None for s in both)],
                         "censored": [iv.censored_cell, iv.censored_sync],
                         "family": "primary" if is_primary else "exploratory",
                         "verdict": verdict(iv, better, words)})
    return rows
