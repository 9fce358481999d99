"""``tools/experiment.py``: the time-to-reward experiment at its ``--smoke`` size (real ``april up``
runs of a tiny policy), its simulated projection, its report and docs block, and bad configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_async.experiments.grid import Cell, ExperimentError, experiment_cells, load_experiment
from april_async.experiments.runs import resumable
from april_async.testing.procs import load_tool

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
PRESET = ROOT / "launch/experiments/time_to_reward.toml"
FIGURES = ("reward_vs_time.png", "reward_vs_samples.png", "time_to_reward.png", "time_split.png", "staleness.png")


def experiment(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/experiment.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_the_smoke_size_runs_each_cell_for_its_window_and_reports(tmp_path):
    out = tmp_path / "out"
    res = experiment(str(PRESET), "--smoke", "--out", str(out))
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert res.stdout.count("warm start done") == 1

    doc = json.loads((out / "results.json").read_text())
    window = doc["settings"]["duration_s"]
    assert sorted(r["cell"] for r in doc["runs"]) == ["april-r2-eta4", "sync"]
    # the cells ran in the order drawn for the seed, recorded with the runs (issue 43)
    assert ([r["cell"] for r in doc["runs"]] == doc["orders"]["0"]
            and [r["order"] for r in doc["runs"]] == [0, 1])
    for run in doc["runs"]:
        assert run["status"] == "ok", run
        assert run["steps"] >= 2 and run["tokens_per_s"] > 0
        times = [p[0] for p in run["curve"]]
        assert times[0] == 0 and times[-1] <= window + 1e-6  # only the steps inside the window count
        assert 0.0 <= run["reward_final"] <= 1.0
        assert 0.0 <= run["wait_frac"] + run["train_frac"] + run["handoff_frac"] <= 1.05
        assert run["ess"] is not None and 0.0 < run["ess"] <= 1.0 + 1e-6
        assert 0.0 < run["gen_slot_frac"] <= run["gen_busy_frac"] <= 1.0 + 1e-6  # from the generators' busy lines
        run_dir = out / "cells" / run["cell"] / f"seed{run['seed']}"
        assert json.loads((run_dir / "broker_state.json").read_text())["balanced"]
        learner = json.loads((run_dir / "config" / "learner-0.json").read_text())
        assert Path(learner["checkpoint"]) == (out / "init").resolve()  # one warm start for every run
        assert json.loads((run_dir / "config" / "broker.json").read_text())["prompts"]["seed"] == run["seed"]
        # The held-out evaluation: the initial policy at t = 0, then the checkpoints inside the window.
        evals = run["eval_curve"]
        assert evals[0] == [0.0, 0, doc["eval_initial"]] and len(evals) >= 2
        assert all(0 < t <= window + 1e-6 for t, _, _ in evals[1:]) and [p[1] for p in evals] == sorted(p[1] for p in evals)
        assert all(0.0 <= r <= 1.0 for _, _, r in evals) and run["eval_final"] == evals[-1][2]
    sync, april = doc["cells"]
    assert sync["off_policy_frac"] == 0.0 and sync["runs_ok"] == 1 and april["mode"] == "april"
    assert "| sync |" in (out / "results.md").read_text()
    for name in FIGURES + ("eval_vs_time.png",):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) < 100_000, name

    # tools/abort_cost.py reads the same runs: every step's wait and decoding, on and off its batch
    cost = subprocess.run([sys.executable, "tools/abort_cost.py", "--experiment", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert cost.returncode == 0, cost.stderr
    assert "| april-r2-eta4 | 0 |" in cost.stdout and "| sync | 0 |" in cost.stdout

    # --resume over a finished experiment keeps every run as it was and runs none.
    again = experiment(str(PRESET), "--smoke", "--out", str(out), "--resume")
    assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
    assert again.stdout.count("kept (finished before; --resume)") == 2 and "warm start done" not in again.stdout
    resumed = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["cell"], r["curve"], r["eval_curve"]) for r in resumed] == \
        [(r["cell"], r["curve"], r["eval_curve"]) for r in doc["runs"]]


def test_the_simulated_projection_prints_the_grid(tmp_path):
    cfg = tmp_path / "exp.toml"
    cfg.write_text(PRESET.read_text().replace("generators = 100", "generators = 4").replace("slots = 64", "slots = 8")
                   .replace("max_response_tokens = 8192", "max_response_tokens = 256"))
    res = experiment(str(cfg), "--sim", "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stderr
    rows = json.loads((tmp_path / "out" / "sim.json").read_text())["cells"]
    assert [r["cell"] for r in rows] == ["sync", "april-r2-eta4", "april-r2-eta4-inflight", "sync-2B",
                                         "async-r2-eta4-perstep", "april-r2-eta4-inflight-recompute"]
    assert all(r["ledger_ok"] and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["train_s"] > 0  # calibrated from sim_train_share
    assert "| sync |" in res.stdout
    # A cell's own `set` (an engine setting) is beyond the simulator: its row says so.
    assert rows[-1]["not_simulated"] == ["generator.torch.on_swap='recompute'"]
    assert "KV recomputed (not simulated: `generator.torch.on_swap='recompute'`; the cell without it) |" in res.stdout


def test_report_redraws_from_results_and_writes_the_docs_block(tmp_path, monkeypatch):
    tool = load_tool("experiment")
    page = tmp_path / "experiments.md"
    page.write_text("# Experiments\n\nintro\n\n<!-- experiment:t:begin -->\nold\n<!-- experiment:t:end -->\n\nafter\n")
    monkeypatch.setattr(tool, "DOCS_PAGE", page)
    out = tmp_path / "out"
    out.mkdir()
    curve = [[float(i), 64 * (i + 1), min(1.0, 0.4 + 0.01 * i)] for i in range(60)]
    runs = [{"cell": cell, "seed": seed, "status": "ok", "steps": 59, "tokens_per_s": 1000.0 + seed,
             "reward_final": 0.9, "off_policy_frac": 0.0 if cell == "sync" else 0.4, "discarded_frac": 0.1,
             "retired_frac": 0.0, "ess": 0.99, "ess_min": 0.9, "lag_mean": 0.5, "wait_frac": 0.6, "train_frac": 0.3,
             "handoff_frac": 0.05, "step_s_mean": 1.0, "gen_tokens_per_s": 1200.0, "t_0.5": 10.0 + seed,
             "t_0.9": None, "staleness_tokens": {"0": 10, "1": 5}, "curve": curve}
            for cell in ("sync", "april-r2-eta4") for seed in (0, 1)]
    (out / "results.json").write_text(json.dumps({"runs": runs}))
    cfg = tmp_path / "exp.toml"
    cfg.write_text(f'[experiment]\nname = "t"\nbase = "{ROOT / "launch/addchain.toml"}"\nout = "{out}"\n'
                   f'docs = "{tmp_path / "figs"}"\nlevels = [0.5, 0.9]\nduration_s = 60\nseeds = [0, 1]\n'
                   f'cells = [{{ mode = "sync" }}, {{ mode = "april", r = 2.0, eta = 4 }}]\n')
    assert tool.main([str(cfg), "--report", "--docs"]) == 0
    text = page.read_text()
    assert text.startswith("# Experiments\n\nintro\n") and text.endswith("\nafter\n") and "old" not in text
    rows: dict[str, str] = {}
    for line in text.splitlines():  # the time-to-reward table's rows (the first table)
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0], line)
    assert "| april r=2 η=4" in rows and "[1.00×]" in rows["| april r=2 η=4"]  # relative to sync
    assert "×" not in rows["| sync"]
    assert "— (0/2)" in text  # a level no seed reached
    for name in FIGURES:
        assert (tmp_path / "figs" / name).read_bytes().startswith(PNG), name

    # issue 43: every run's numbers are kept beside the figures, and rebuild the same tables alone
    kept = json.loads((tmp_path / "figs" / "runs.json").read_text())
    assert [(r["cell"], r["seed"], r["curve"]) for r in kept["runs"]] == [(r["cell"], r["seed"], r["curve"])
                                                                          for r in runs]
    first = (out / "results.md").read_text()
    (out / "results.json").unlink()
    page.write_text("# Experiments\n\n<!-- experiment:t:begin -->\n<!-- experiment:t:end -->\n")
    assert tool.main([str(cfg), "--report", "--from-docs", "--docs"]) == 0
    assert (out / "results.md").read_text() == first and first in page.read_text()
    assert tool.main([str(cfg), "--from-docs"]) == 2  # only with --report


def test_held_out_levels_are_read_off_sync_and_timed_between_checkpoints(tmp_path):
    """The held-out reward's levels: the initial policy plus fractions of sync's climb; each is
    timed linearly between evaluated checkpoints, and reported against sync."""
    tool = load_tool("experiment")
    out = tmp_path / "out"
    out.mkdir()
    curves = {"sync": [[0.0, 0, 0.5], [30.0, 20, 0.6], [60.0, 40, 0.7]],
              "april-r2-eta4": [[0.0, 0, 0.5], [30.0, 25, 0.7], [60.0, 50, 0.75]]}
    runs = [{"cell": cell, "seed": 0, "status": "ok", "steps": 40, "reward_final": 0.6,
             "curve": [[0.0, 64, 0.5], [60.0, 128, 0.6]],
             "eval_curve": curve, "staleness_tokens": {}} for cell, curve in curves.items()]
    (out / "results.json").write_text(json.dumps({"runs": runs, "eval_initial": 0.5}))
    cfg = tmp_path / "exp.toml"
    cfg.write_text(f'[experiment]\nname = "t"\nbase = "{ROOT / "launch/addchain.toml"}"\nout = "{out}"\n'
                   f'levels = []\nsync_levels = [0.5, 1.0]\nma_steps = 1\nduration_s = 60\nseeds = [0]\n'
                   f'eval_every_steps = 5\ncells = [{{ mode = "sync" }}, {{ mode = "april", r = 2.0, eta = 4 }}]\n')
    assert tool.main([str(cfg), "--report"]) == 0
    doc = json.loads((out / "results.json").read_text())
    sync, april = doc["cells"]
    assert sync["te_0.6"] == pytest.approx(30.0) and sync["te_0.7"] == pytest.approx(60.0)  # sync's climb: 0.5 -> 0.7
    assert april["te_0.6"] == pytest.approx(15.0) and april["te_0.7"] == pytest.approx(30.0)
    assert april["eval_final"] == 0.75
    text = (out / "results.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| april r=2 η=4 | 0.750"))
    assert "15 [0.50×]" in row and "30 [0.50×]" in row
    assert (out / "eval_vs_time.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize("text,named", [
    ('[experiment]\nname = "x"\nbase = "{base}"\ncells = [{{ mode = "turbo" }}]\n', "turbo"),
    ('[experiment]\nname = "x"\nbase = "{base}"\ncells = [{{ mode = "april", eta = -1 }}]\n', "η = -1"),
    ('[experiment]\nname = "x"\nbase = "{base}"\ncells = [{{ mode = "april", r = 0.5 }}]\n', "r = 0.5"),
    ('[experiment]\nname = "x"\nbase = "{tmp}/missing.toml"\ncells = [{{ mode = "sync" }}]\n', "does not exist"),
    ('[experiment]\nname = "x"\nbase = "{base}"\ncells = []\n', "cells"),
    ('[experiment]\nname = "x"\nbase = "{base}"\ncells = [{{ mode = "sync" }}]\n[runs]\n', "unknown table [runs]"),
])
def test_bad_experiment_configs_are_one_line_errors(tmp_path, capsys, text, named):
    cfg = tmp_path / "exp.toml"
    cfg.write_text(text.format(base=ROOT / "launch/addchain.toml", tmp=tmp_path))
    assert load_tool("experiment").main([str(cfg), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_resume_keeps_finished_runs_of_the_same_settings_only(tmp_path):
    """``--resume``: a run is kept when it finished, its directory is still there and it is in the
    grid; results made with other settings or another initial policy are refused, not mixed in."""
    out = tmp_path / "out"
    settings = {"duration_s": 90, "eval_problems": 256, "levels": [0.5]}
    meta = {"settings": settings, "initial_policy": "/init", "eval_initial": 0.625, "smoke": False}
    cells = [Cell(mode="sync"), Cell(mode="april", r=2.0, eta=4)]
    assert resumable(out, meta, cells, [0, 1]) == {}  # nothing yet: every run is to do
    runs = [{"cell": "sync", "seed": 0, "status": "ok"}, {"cell": "sync", "seed": 1, "status": "failed (exit 1)"},
            {"cell": "april-r2-eta4", "seed": 0, "status": "ok"}, {"cell": "april-r2-eta4", "seed": 1, "status": "ok"},
            {"cell": "async-r2-eta4", "seed": 0, "status": "ok"}]
    for run in runs:
        d = out / "cells" / run["cell"] / f"seed{run['seed']}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("{}\n")
    (out / "results.json").write_text(json.dumps({**meta, "eval_initial": 0.625 + 1 / 256, "runs": runs}))
    (out / "cells" / "april-r2-eta4" / "seed1" / "metrics.jsonl").unlink()  # its run directory is gone
    kept = resumable(out, meta, cells, [0, 1])
    assert sorted(kept) == [("april-r2-eta4", 0), ("sync", 0)]  # not failed, not gone, not outside the grid
    assert resumable(out, {**meta, "settings": {**settings, "levels": [0.7]}}, cells, [0, 1]) == kept  # report-only

    for key, value in (("settings", {**settings, "duration_s": 60}), ("initial_policy", "/other"),
                       ("eval_initial", 0.7), ("smoke", True)):
        with pytest.raises(ExperimentError, match=f"another {key}"):
            resumable(out, {**meta, key: value}, cells, [0, 1])
    (out / "results.json").write_text("{not json")
    with pytest.raises(ExperimentError, match="not readable JSON"):
        resumable(out, meta, cells, [0, 1])


@pytest.mark.parametrize("preset", sorted((ROOT / "launch/experiments").glob("*.toml")), ids=lambda p: p.stem)
def test_every_preset_loads_and_plans_one_april_up_per_cell_and_seed(preset, capsys):
    """The presets a user runs as they are (the GPU one included, which cannot run here): each
    validates, its base with it, and names a command for every cell at every seed."""
    from april_async.up import load_document, plan

    tool = load_tool("experiment")
    cfg, _ = load_experiment(preset, False)
    plan(load_document(cfg.base, cfg.set), None)  # the base with the preset's sets: every section valid
    assert tool.main([str(preset), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(experiment_cells(cfg)) * len(cfg.seeds)
    assert all(" -m april_async.cli up --config " in line for line in lines)
