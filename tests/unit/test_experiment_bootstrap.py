"""The paired bootstrap of a cell against sync, and its verdicts, on synthetic numbers."""

import pytest

from april_async.experiments.bootstrap import Interval, against_sync, paired_ratio, verdict
from april_async.experiments.report import paired_table


def test_a_cell_that_is_half_of_sync_on_every_seed_has_a_tight_interval_and_is_faster():
    sync = {0: 40.0, 1: 60.0, 2: 50.0, 3: 80.0}
    cell = {s: v / 2 for s, v in sync.items()}
    iv = paired_ratio(cell, sync)
    assert iv.ratio == pytest.approx(0.5) and iv.lo == pytest.approx(0.5) and iv.hi == pytest.approx(0.5)
    assert iv.pairs == 4
    assert verdict(iv, "lower") == "faster than sync"
    assert verdict(iv, "higher") == "slower than sync"  # half the tokens/s
    assert verdict(iv, "higher", ("higher", "lower")) == "lower than sync"


def test_pairing_keeps_each_seeds_numbers_together():
    # Seeds differ a lot, the cell is 10 % faster on each: paired, the interval excludes 1.
    sync = {0: 20.0, 1: 100.0, 2: 45.0, 3: 70.0, 4: 30.0}
    cell = {s: 0.9 * v for s, v in sync.items()}
    iv = paired_ratio(cell, sync)
    assert iv.hi < 1.0 and verdict(iv, "lower") == "faster than sync"


def test_a_cell_faster_on_some_seeds_and_slower_on_others_is_not_distinguishable():
    sync = {0: 50.0, 1: 50.0, 2: 50.0, 3: 50.0}
    cell = {0: 30.0, 1: 70.0, 2: 35.0, 3: 65.0}
    iv = paired_ratio(cell, sync)
    assert iv.lo < 1.0 < iv.hi and iv.ratio == pytest.approx(1.0)
    assert verdict(iv, "lower") == "not distinguishable"


def test_only_seeds_both_have_are_paired_and_one_pair_gives_no_interval():
    assert paired_ratio({0: 1.0, 1: 2.0}, {1: 2.0, 2: 3.0}) is None  # one common seed
    assert verdict(None, "lower") == "not distinguishable"
    iv = paired_ratio({0: 1.0, 1: 2.0, 5: 9.0}, {0: 2.0, 1: 4.0, 2: 3.0})
    assert iv.pairs == 2 and iv.ratio == pytest.approx(0.5)


def test_the_interval_is_the_same_for_the_same_numbers():
    sync, cell = {0: 3.0, 1: 5.0, 2: 4.0}, {0: 2.0, 1: 6.0, 2: 3.0}
    assert paired_ratio(cell, sync) == paired_ratio(cell, sync)


def test_verdicts_at_the_edges():
    assert verdict(Interval(1.2, 1.01, 1.5, 3), "lower") == "slower than sync"
    assert verdict(Interval(1.2, 1.0, 1.5, 3), "lower") == "not distinguishable"  # touches 1
    assert verdict(Interval(1.2, 1.01, 1.5, 3), "higher", ("higher", "lower")) == "higher than sync"


def test_every_claim_of_every_cell_against_sync_and_its_table():
    runs = []
    for seed, (ts, tc) in enumerate([(40.0, 20.0), (60.0, 30.0), (50.0, 26.0)]):
        runs.append({"cell": "sync", "seed": seed, "status": "ok", "t_0.6": ts, "tokens_per_s": 100.0 + seed,
                     "eval_final": 0.80, "te_0.7": 30.0})
        runs.append({"cell": "april-r2-eta4", "seed": seed, "status": "ok", "t_0.6": tc, "tokens_per_s": 100.0 + seed,
                     "eval_final": 0.80 + (0.01 if seed else -0.01), "te_0.7": None})
    runs.append({"cell": "april-r2-eta4", "seed": 3, "status": "failed (exit 1)"})
    rows = against_sync(["sync", "april-r2-eta4"], runs, [0.6], [0.7])
    got = {r["key"]: r for r in rows}
    assert [r["claim"] for r in rows] == ["time to batch reward 0.6", "samples to batch reward 0.6", "trained tokens/s",
                                          "time to held-out reward 0.7", "samples to held-out reward 0.7",
                                          "held-out reward at the end"]
    assert got["s_0.6"]["pairs"] == 0  # these runs have no samples to it: no pair, no interval
    assert got["t_0.6"]["verdict"] == "faster than sync" and got["t_0.6"]["pairs"] == 3
    assert got["tokens_per_s"]["verdict"] == "not distinguishable"  # equal on every seed: [1, 1]
    assert got["te_0.7"]["pairs"] == 0 and got["te_0.7"]["ratio"] is None
    assert got["eval_final"]["verdict"] == "not distinguishable"
    table = paired_table(rows, {"april-r2-eta4": "april r=2 η=4"}, 3)
    assert "| april r=2 η=4 | time to batch reward 0.6 | 0.51× | [0.50, 0.52] | 3 | faster than sync |" in table
    assert "| april r=2 η=4 | time to held-out reward 0.7 | — | — | 0 | not distinguishable |" in table
