"""An experiment's numbers from small synthetic runs: trained samples to a reward level (beside
time), with their paired intervals, and the batch reward split by response length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from april_async.experiments.grid import Cell, Settings
from april_async.experiments.paired import against_sync
from april_async.experiments.numbers import (aggregate, length_bins, length_edges, length_hist, length_split,
                                             run_numbers, samples_to, samples_to_eval)
from april_async.experiments.report import length_table, samples_table


def test_samples_to_a_level_count_from_the_first_step_as_time_does():
    # [t, samples trained so far (the first step's included), batch reward]
    curve = [[0.0, 64, 0.2], [10.0, 128, 0.4], [20.0, 192, 0.6], [30.0, 256, 0.8]]
    assert samples_to(curve, 0.6, 1) == 128  # 192 - the first step's 64
    assert samples_to(curve, 0.5, 2) == 128  # the 2-step mean: 0.3, 0.5 at t = 20
    assert samples_to(curve, 0.9, 1) is None and samples_to([], 0.5, 1) is None


def test_samples_to_a_held_out_level_place_each_checkpoint_at_its_samples():
    curve = [[0.0, 64, 0.2], [10.0, 128, 0.4], [20.0, 192, 0.6], [30.0, 256, 0.8]]
    eval_curve = [[0.0, 0, 0.5], [10.0, 2, 0.6], [30.0, 4, 0.8]]  # [t, step, held-out reward]
    assert samples_to_eval(eval_curve, curve, 0.6) == pytest.approx(64)
    assert samples_to_eval(eval_curve, curve, 0.7) == pytest.approx(64 + (192 - 64) / 2)
    assert samples_to_eval(eval_curve, curve, 0.9) is None


def test_samples_claims_are_paired_against_sync_with_their_own_verdict_words():
    runs = []
    for seed in range(4):  # the same time, half the samples: faster per sample only
        runs.append({"cell": "sync", "seed": seed, "status": "ok", "t_0.6": 30.0 + seed, "s_0.6": 2000.0 + seed})
        runs.append({"cell": "sync-2B", "seed": seed, "status": "ok", "t_0.6": 30.0 + seed, "s_0.6": 4000.0 + seed})
    rows = {(r["cell"], r["claim"]): r for r in against_sync(["sync", "sync-2B"], runs, [0.6])}
    assert rows["sync-2B", "time to batch reward 0.6"]["verdict"] == "not distinguishable"
    more = rows["sync-2B", "samples to batch reward 0.6"]
    assert more["ratio"] == pytest.approx(2.0, rel=1e-3) and more["verdict"] == "more samples than sync"


def test_samples_table_sits_beside_the_times():
    runs = [{"cell": c, "seed": s, "status": "ok", "s_0.6": v * (s + 1), "se_0.7": None}
            for c, v in (("sync", 1000.0), ("sync-2B", 1500.0)) for s in (0, 1)]
    cells = aggregate([Cell(mode="sync"), Cell(mode="sync", groups_scale=2)], runs, [0.6], [0.7])
    text = samples_table(cells, [0.6], [0.7])
    row = next(line for line in text.splitlines() if line.startswith("| sync 2B |"))
    assert "2,250 ± 1,061 [1.50×]" in row and "— (0/2)" in row


def test_length_bins_are_quantiles_of_every_cells_samples_pooled():
    a = length_hist([{"sample_response_lens": [10, 10, 20, 30], "sample_rewards": [1.0, 0.0, 1.0, 0.0]}])
    assert a == {"10": [2, 1.0], "20": [1, 1.0], "30": [1, 0.0]}
    b = length_hist([{"sample_response_lens": [40, 50], "sample_rewards": [0.0, 0.0]}, {"reward_mean": 0.5}])
    runs = [{"status": "ok", "length_hist": a}, {"status": "ok", "length_hist": b},
            {"status": "failed (exit 1)", "length_hist": {"999": [100, 0.0]}}]
    edges = length_edges(runs)  # 10 10 20 30 40 50: a third at 10, two thirds at 30
    assert edges == [10, 30] and length_bins(edges) == ["≤ 10 tok", "11–30 tok", "> 30 tok"]
    assert length_split(a, edges) == [(0.5, 0.5), (0.5, 0.5), (0.0, None)]
    assert length_edges([{"status": "ok", "length_hist": {"8": [5, 1.0]}}]) == []  # every length ties
    assert length_edges([{"status": "ok"}]) == [] and length_bins([]) == ["all lengths"]


def test_a_cell_that_delivers_short_answers_first_shows_it_in_the_split():
    short = {"10": [8, 8.0], "50": [2, 0.0]}  # most samples short, and those are the solved ones
    even = {"10": [5, 4.0], "50": [5, 1.0]}
    runs = [{"cell": "sync", "seed": s, "status": "ok", "length_hist": even} for s in (0, 1)] + [
        {"cell": "april-r2-eta4", "seed": s, "status": "ok", "length_hist": short} for s in (0, 1)]
    edges = length_edges(runs)
    assert edges == [10]
    cells = aggregate([Cell(mode="sync"), Cell(mode="april", r=2.0, eta=4)], runs, [], [], edges)
    sync, april = (c["length_split"] for c in cells)
    assert [b["share"] for b in sync] == [0.5, 0.5] and [b["reward"] for b in sync] == [0.8, 0.2]
    assert [b["share"] for b in april] == [0.8, 0.2] and [b["reward"] for b in april] == [1.0, 0.0]
    text = length_table(cells, edges)
    assert "| ≤ 10 tok: share | ≤ 10 tok: reward | > 10 tok: share | > 10 tok: reward |" in text
    assert "| april r=2 η=4 | 80 % | 1.000 | 20 % | 0.000 |" in text


def test_a_runs_numbers_carry_its_length_histogram_over_the_window(tmp_path):
    run = tmp_path / "run"
    (run / "config").mkdir(parents=True)
    (run / "config" / "broker.json").write_text(json.dumps({"rollout": {"group_size": 2}}))
    rows = []
    for step in range(4):
        lens, rewards = [10 + step, 20], [1.0, 0.0]
        rows.append({"step": step + 1, "time": 100.0 + 10 * step, "reward_mean": 0.5, "groups": 1, "tokens": 30,
                     "wait_s": 1.0, "train_s": 1.0, "step_s": 1.5, "sample_response_lens": lens,
                     "sample_rewards": rewards})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Settings(name="t", base=Path("base.toml"), cells=[{"mode": "sync"}], duration_s=25.0, ma_steps=1)
    out = run_numbers(run, cfg)
    # the steps that end inside the window, after the first (as steps and tokens/s count them)
    assert out["length_hist"] == {"11": [1, 1.0], "12": [1, 1.0], "20": [2, 0.0]}
    assert out["curve"][-1][1] == 6 and samples_to(out["curve"], 0.5, 1) == 0


def test_the_held_out_answers_are_split_at_their_own_edges():
    runs = [{"cell": "sync", "seed": s, "status": "ok", "length_hist": {"30": [4, 2.0]},
             "eval_length_hist": {"8": [6, 6.0], "16": [2, 0.0]}} for s in (0, 1)] + [
        {"cell": "april-r2-eta4", "seed": s, "status": "ok", "length_hist": {"30": [4, 2.0]},
         "eval_length_hist": {"8": [4, 4.0], "16": [4, 1.0]}} for s in (0, 1)]
    edges, eval_edges = length_edges(runs), length_edges(runs, key="eval_length_hist")
    assert edges == [] and eval_edges == [8]
    cells = aggregate([Cell(mode="sync"), Cell(mode="april", r=2.0, eta=4)], runs, [], [], edges, eval_edges)
    assert [b["bin"] for b in cells[0]["length_split"]] == ["all lengths"]
    assert [(b["share"], b["reward"]) for b in cells[1]["eval_length_split"]] == [(0.5, 1.0), (0.5, 0.25)]
    text = length_table(cells, eval_edges, held_out=True)
    assert text.startswith("Held-out reward by response length") and "| sync | 75 % | 1.000 | 25 % | 0.000 |" in text


def test_each_figures_last_point_is_its_tables_value():
    """Issue 43: the right edge of a figure was a mean over the seeds that still had a point there (the
    KV-recomputed cell's held-out curve ended near 0.52, its table said 0.405). Every seed now holds
    its last value to the edge: the last point is the mean over every seed of the table's number."""
    from april_async.experiments.plot import eval_series, reward_series

    cfg = Settings(name="t", base=Path("launch/addchain.toml"), cells=[{"mode": "sync"}], duration_s=30.0,
                   ma_steps=2)
    runs = []
    for seed, (steps, evals) in enumerate([(30, [[0.0, 0, 0.40], [15.0, 5, 0.50], [30.0, 10, 0.60]]),
                                           (12, [[0.0, 0, 0.40], [11.0, 4, 0.30]]),  # its last checkpoint:
                                                                                     # early
                                           (25, [[0.0, 0, 0.40], [20.0, 5, 0.55]])]):
        curve = [[float(i), 32 * (i + 1), 0.3 + 0.01 * i + 0.05 * seed] for i in range(steps)]
        runs.append({"cell": "sync", "seed": seed, "status": "ok", "curve": curve, "eval_curve": evals,
                     "eval_final": evals[-1][2], "reward_final": sum(p[2] for p in curve[-2:]) / 2})
    cells = aggregate([Cell(mode="sync")], runs, [])
    (_, held_out, _, _), = eval_series(cfg, cells, runs).values()
    assert held_out[-1] == pytest.approx(cells[0]["eval_final"]) == pytest.approx((0.60 + 0.30 + 0.55) / 3)
    for axis in (0, 1):
        (_, batch, _, _), = reward_series(cfg, cells, runs, axis).values()
        assert batch[-1] == pytest.approx(cells[0]["reward_final"])
