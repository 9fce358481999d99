"""A cell against sync, paired over seeds (``experiments/paired.py``): the t-interval on log-ratios,
its coverage under no difference (simulated over log-normal seeds, beside the percentile bootstrap it
replaced), censored times, the verdict rules, and the rows of every claim."""

from __future__ import annotations

import math
import random

import pytest

from april_async.experiments.paired import (LEVEL, MIN_PAIRS, Interval, against_sync, paired_interval, t_cdf,
                                            t_quantile, verdict)
from april_async.experiments.report import paired_table


@pytest.mark.parametrize(("df", "q975"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646), (30, 2.0423)])
def test_t_quantiles_match_the_tables(df, q975):
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert t_cdf(t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-9)
    assert t_quantile(0.025, df) == pytest.approx(-q975, abs=1e-4)


# ---------------------------------------------------------------------- coverage under no difference


def lognormal_pairs(rng: random.Random, n: int, cv: float, rho: float) -> tuple[dict, dict]:
    """``n`` seeds of a cell and sync with no true difference: log-normal values of spread ``cv``
    whose seed effects the two cells share at correlation ``rho``."""
    sigma = math.sqrt(math.log(1 + cv * cv))
    cell, sync = {}, {}
    for s in range(n):
        shared, a, b = rng.gauss(0, 1), rng.gauss(0, 1), rng.gauss(0, 1)
        cell[s] = 50.0 * math.exp(sigma * (math.sqrt(rho) * shared + math.sqrt(1 - rho) * a))
        sync[s] = 50.0 * math.exp(sigma * (math.sqrt(rho) * shared + math.sqrt(1 - rho) * b))
    return cell, sync


def percentile_bootstrap(cell: dict, sync: dict, rng: random.Random, resamples: int) -> tuple[float, float]:
    """The interval the project used before issue 43: the ratio of means over paired resamples, 2.5th
    and 97.5th percentiles (kept here as the control the coverage test must tell apart)."""
    seeds = sorted(cell)
    ratios = []
    for _ in range(resamples):
        pick = [rng.choice(seeds) for _ in seeds]
        ratios.append(sum(cell[s] for s in pick) / sum(sync[s] for s in pick))
    ratios.sort()
    return ratios[round(0.025 * (resamples - 1))], ratios[round(0.975 * (resamples - 1))]


COVERAGE_REPS = 2000


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("cv", [0.05, 0.30])
@pytest.mark.parametrize("rho", [0.0, 0.8])
def test_the_interval_covers_no_difference_95_percent_of_the_time(n, cv, rho):
    """Issue 43 asks for >= 94 % at 8 pairs and >= 92 % at 4 (the bootstrap gave 86-90 % and 78-80 %).
    Over log-normal seeds the t-interval on log-ratios is exact: 95 % up to the simulation's error
    (sd 0.5 % at 2,000 draws)."""
    rng = random.Random(f"{n}-{cv}-{rho}")
    covered = 0
    for _ in range(COVERAGE_REPS):
        iv = paired_interval(*lognormal_pairs(rng, n, cv, rho))
        covered += iv.lo <= 1.0 <= iv.hi
    coverage = covered / COVERAGE_REPS
    print(f"n={n} cv={cv} rho={rho}: coverage {coverage:.3f}")
    assert coverage >= (0.94 if n >= 8 else 0.92)
    assert coverage <= 0.97  # not bought with needless width


def test_the_percentile_bootstrap_it_replaced_under_covers_at_four_pairs():
    """The control: the same draws, the old interval. It must fail the bar the new one passes, or the
    coverage test could not tell a wrong method from a right one."""
    rng = random.Random(43)
    boot = t_int = 0
    reps = 400
    for _ in range(reps):
        cell, sync = lognormal_pairs(rng, 4, 0.30, 0.0)
        lo, hi = percentile_bootstrap(cell, sync, rng, 400)
        boot += lo <= 1.0 <= hi
        iv = paired_interval(cell, sync)
        t_int += iv.lo <= 1.0 <= iv.hi
    print(f"4 pairs, cv 0.3: bootstrap {boot / reps:.3f}, t on logs {t_int / reps:.3f}")
    assert boot / reps < 0.88 < 0.92 <= t_int / reps


def test_censored_times_give_few_wrong_verdicts_and_find_a_real_difference():
    """Times to a level, censored at the window's end (a quarter of sync's seeds never reach it). With
    no difference, a verdict either way is wrong: at most 5 % of 8-pair experiments give one. With the
    cell twice as slow (more of its seeds censored), most find it slower, and none faster."""
    rng = random.Random(7)
    sigma = math.sqrt(math.log(1 + 0.3 ** 2))
    window = 50.0 * math.exp(sigma * 0.674)  # sync's 75th percentile

    def draw(scale: float) -> dict:
        out = {}
        for s in range(8):
            t = scale * 50.0 * math.exp(sigma * rng.gauss(0, 1))
            out[s] = t if t <= window else None  # never reached within the window
        return out

    censor = {s: (window, window) for s in range(8)}
    wrong = 0
    for _ in range(1000):
        said = verdict(paired_interval(draw(1.0), draw(1.0), censor_at=censor), "lower")
        wrong += said in ("faster than sync", "slower than sync")
    verdicts = [verdict(paired_interval(draw(2.0), draw(1.0), censor_at=censor), "lower") for _ in range(500)]
    print(f"no difference: {wrong / 1000:.3f} wrong; twice as slow: "
          f"{verdicts.count('slower than sync') / 500:.2f}"
          f" slower, {verdicts.count('faster than sync')} faster")
    assert wrong / 1000 <= 0.05
    assert verdicts.count("slower than sync") / 500 >= 0.5 and verdicts.count("faster than sync") == 0


# ---------------------------------------------------------------------- the rules


def test_a_cell_that_is_half_of_sync_on_every_seed():
    sync = {0: 40.0, 1: 60.0, 2: 50.0, 3: 80.0}
    iv = paired_interval({s: v / 2 for s, v in sync.items()}, sync)
    assert iv.ratio == pytest.approx(0.5) and iv.lo == pytest.approx(0.5) and iv.hi == pytest.approx(0.5)
    assert iv.pairs == 4 and iv.level == LEVEL
    assert verdict(iv, "lower") == "faster than sync"
    assert verdict(iv, "higher") == "slower than sync"  # half the tokens/s
    assert verdict(iv, "higher", ("higher", "lower")) == "lower than sync"


def test_pairing_keeps_each_seeds_numbers_together():
    sync = {0: 20.0, 1: 100.0, 2: 45.0, 3: 70.0, 4: 30.0}  # seeds differ a lot; the cell is 10 % faster on
                                                           # each
    cell = {s: 0.9 * v * (1.01 if s % 2 else 0.99) for s, v in sync.items()}
    iv = paired_interval(cell, sync)
    assert iv.hi < 1.0 and verdict(iv, "lower") == "faster than sync"


def test_a_cell_faster_on_some_seeds_and_slower_on_others_is_not_distinguishable():
    sync = {0: 50.0, 1: 50.0, 2: 50.0, 3: 50.0}
    iv = paired_interval({0: 30.0, 1: 70.0, 2: 35.0, 3: 65.0}, sync)
    assert iv.lo < 1.0 < iv.hi and verdict(iv, "lower") == "not distinguishable"


def test_fewer_than_four_pairs_give_a_ratio_and_no_verdict_and_none_says_no_data():
    iv = paired_interval({0: 1.0, 1: 2.0, 2: 3.0}, {0: 2.0, 1: 4.0, 2: 6.0})
    assert MIN_PAIRS == 4 and iv.pairs == 3 and iv.ratio == pytest.approx(0.5) and iv.lo is None
    assert verdict(iv, "lower") == "no verdict: 3 pairs (at least 4)"
    assert verdict(paired_interval({0: 1.0}, {1: 2.0}), "lower") == "no data"


def test_a_level_never_reached_is_censored_at_the_window_and_counts_against_who_missed_it():
    sync = {0: 20.0, 1: 25.0, 2: 30.0, 3: 22.0, 4: 28.0}
    window = {s: (60.0, 60.0) for s in sync}
    # the cell reaches it on one seed only: dropped, it would look as fast as sync
    cell = {0: 21.0, 1: None, 2: None, 3: None, 4: None}
    dropped = paired_interval({s: v for s, v in cell.items() if v is not None}, sync)
    kept = paired_interval(cell, sync, censor_at=window)
    assert (dropped.pairs == 1 and dropped.ratio == pytest.approx(1.05) and kept.pairs == 5
            and kept.censored_cell == 4)
    assert kept.ratio > 1.5 and verdict(kept, "lower") == "slower than sync"
    # censored seeds flatter the cell's side: a verdict in its favour is withheld
    late = {0: 50.0, 1: 55.0, 2: 58.0, 3: 52.0, 4: 57.0, 5: 54.0}
    fast = paired_interval({0: 10.0, 1: 11.0, 2: 12.0, 3: 10.0, 4: 11.0, 5: None}, late,
                           censor_at={s: (60.0, 60.0) for s in late})
    assert fast.hi < 1.0 and verdict(fast, "lower").startswith("not distinguishable (1 censored seed of "
                                                               "the cell")
    # neither reached it on a seed: that seed says nothing about the difference
    both = paired_interval({**cell, 5: None}, {**sync, 5: None}, censor_at={**window, 5: (60.0, 60.0)})
    assert both.pairs == 5 and both.neither == 1 and both.seeds == 6


def test_verdicts_at_the_edges():
    assert verdict(Interval(1.2, 1.01, 1.5, 4), "lower") == "slower than sync"
    assert verdict(Interval(1.2, 1.0, 1.5, 4), "lower") == "not distinguishable"  # touches 1
    assert verdict(Interval(1.2, 1.01, 1.5, 4), "higher", ("higher", "lower")) == "higher than sync"
    assert verdict(Interval(0.8, 0.7, 0.9, 4, censored_sync=2), "lower") == "faster than sync"
    assert verdict(Interval(1.3, 1.1, 1.5, 4, censored_sync=2), "lower").endswith("censored seeds of sync "
                                                                                  "flatter it)")


def test_every_claim_of_every_cell_against_sync_primary_ones_adjusted_and_its_table():
    runs = []
    for seed, (ts, tc) in enumerate([(40.0, 20.0), (60.0, 30.0), (50.0, 26.0), (45.0, 23.0), (55.0, 29.0)]):
        runs.append({"cell": "sync", "seed": seed, "status": "ok", "t_0.6": ts, "tokens_per_s": 100.0 + seed,
                     "samples": 900, "eval_final": 0.80, "te_0.7": 30.0, "se_0.7": 300.0, "s_0.6": 400.0})
        runs.append({"cell": "april-r2-eta4", "seed": seed, "status": "ok", "t_0.6": tc,
                     "tokens_per_s": (100.0 + seed) * 1.3, "samples": 1200, "s_0.6": 420.0,
                     "eval_final": 0.80 + (0.01 if seed % 2 else -0.01), "te_0.7": None, "se_0.7": None})
    runs.append({"cell": "april-r2-eta4", "seed": 5, "status": "failed (exit 1)"})
    rows = against_sync(["sync", "april-r2-eta4"], runs, [0.6], [0.7], window_s=50.0,
                        primary={"april-r2-eta4": ["tokens_per_s", "eval_final"]})
    got = {r["key"]: r for r in rows}
    assert [r["claim"] for r in rows] == ["time to batch reward 0.6", "samples to batch reward 0.6",
                                          "trained tokens/s", "time to held-out reward 0.7",
                                          "samples to held-out reward 0.7", "held-out reward at the end"]
    assert got["t_0.6"]["verdict"] == "faster than sync" and got["t_0.6"]["pairs"] == 5
    assert got["tokens_per_s"]["family"] == "primary" and got["tokens_per_s"]["level"] == pytest.approx(0.975)
    assert got["tokens_per_s"]["verdict"] == "faster than sync"  # 1.3x on every seed
    assert got["t_0.6"]["family"] == "exploratory" and got["t_0.6"]["level"] == LEVEL
    # never reached by the cell: censored at the window (time) and at its samples, not dropped
    assert got["te_0.7"]["reached"] == [0, 5] and got["te_0.7"]["pairs"] == 5
    assert (got["te_0.7"]["ratio"] == pytest.approx(50.0 / 30.0)
            and got["te_0.7"]["verdict"] == "slower than sync")
    assert got["se_0.7"]["ratio"] == pytest.approx(1200 / 300.0)
    assert got["eval_final"]["verdict"] == "not distinguishable"
    table = paired_table(rows, {"april-r2-eta4": "april r=2 η=4"}, 5)
    assert "| april r=2 η=4 | trained tokens/s | primary | 1.30× | [1.30, 1.30] (97.5 %) | 5 of 5 | " \
           "faster than sync |" in table
    assert "| april r=2 η=4 | time to held-out reward 0.7 | exploratory | 1.67× | [1.67, 1.67] | 5 of 5; " \
           "reached: cell 0, sync 5 | slower than sync |" in table
