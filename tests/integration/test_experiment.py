"""``tools/experiment.py``: the time-to-reward experiment at its ``--smoke`` size (real ``april up``
runs of a tiny policy), its simulated projection, its report and docs block, and bad configs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
PRESET = ROOT / "launch/experiments/time_to_reward.toml"
FIGURES = ("reward_vs_time.png", "reward_vs_samples.png", "time_to_reward.png", "time_split.png", "staleness.png")


def experiment(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/experiment.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _load_tool():
    spec = importlib.util.spec_from_file_location("experiment_tool", ROOT / "tools/experiment.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_smoke_size_runs_each_cell_for_its_window_and_reports(tmp_path):
    out = tmp_path / "out"
    res = experiment(str(PRESET), "--smoke", "--out", str(out))
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert res.stdout.count("warm start done") == 1

    doc = json.loads((out / "results.json").read_text())
    window = doc["settings"]["duration_s"]
    assert [r["cell"] for r in doc["runs"]] == ["sync", "april-r2-eta4"]
    for run in doc["runs"]:
        assert run["status"] == "ok", run
        assert run["steps"] >= 2 and run["tokens_per_s"] > 0
        times = [p[0] for p in run["curve"]]
        assert times[0] == 0 and times[-1] <= window + 1e-6  # only the steps inside the window count
        assert 0.0 <= run["reward_final"] <= 1.0
        assert 0.0 <= run["wait_frac"] + run["train_frac"] + run["handoff_frac"] <= 1.05
        assert run["ess"] is not None and 0.0 < run["ess"] <= 1.0 + 1e-6
        run_dir = out / "cells" / run["cell"] / f"seed{run['seed']}"
        assert json.loads((run_dir / "broker_state.json").read_text())["balanced"]
        learner = json.loads((run_dir / "config" / "learner-0.json").read_text())
        assert Path(learner["checkpoint"]) == (out / "init").resolve()  # one warm start for every run
        assert json.loads((run_dir / "config" / "broker.json").read_text())["prompts"]["seed"] == run["seed"]
    sync, april = doc["cells"]
    assert sync["off_policy_frac"] == 0.0 and sync["runs_ok"] == 1 and april["mode"] == "april"
    assert "| sync |" in (out / "results.md").read_text()
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) < 100_000, name


def test_the_simulated_projection_prints_the_grid(tmp_path):
    cfg = tmp_path / "exp.toml"
    cfg.write_text(PRESET.read_text().replace("generators = 100", "generators = 4").replace("slots = 64", "slots = 8")
                   .replace("max_response_tokens = 8192", "max_response_tokens = 256"))
    res = experiment(str(cfg), "--sim", "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stderr
    rows = json.loads((tmp_path / "out" / "sim.json").read_text())["cells"]
    assert [r["cell"] for r in rows] == ["sync", "april-r2-eta4", "april-r2-eta4-continue", "april-r1.5-eta4",
                                         "april-r3-eta4", "april-r3-eta4-continue", "async-r2-eta4"]
    assert all(r["ledger_ok"] and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["train_s"] > 0  # calibrated from sim_train_share
    assert "| sync |" in res.stdout


def test_report_redraws_from_results_and_writes_the_docs_block(tmp_path, monkeypatch):
    tool = _load_tool()
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
    assert _load_tool().main([str(cfg), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
