"""``tools/sweep.py``: a grid of cells, simulated (seconds) and engine-backed (real ``april up`` runs)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_async.testing.cluster import TINY_POLICY_TOML
from april_async.testing.procs import load_tool

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

TINY_SIM = """
[sweep]
base = "{base}"
out = "{out}"
modes = ["sync", "april", "async"]
eta = [0, 2]
r = [1.5, 2.0]

[sim]
generators = 4
slots = 8
group_size = 4
max_response_tokens = 256
batches = 2
warmup = 1
"""

TINY_BASE = """
[run]
dir = "{tmp}/unused"
actors = ["broker", "broadcaster", "scorer", "learner", "generator:2"]
duration_s = 120
final_sync_s = 15

[broker.rollout]
mode = "april"
batch_groups = 2
group_size = 2
max_response_tokens = 24

[generator.torch]
slots = 8

[learner]
lr = 1e-4
save_every = 2
"""


def sweep(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/sweep.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def read_csv(path: Path) -> dict[str, dict]:
    with open(path) as f:
        return {row["cell"]: row for row in csv.DictReader(f)}


def test_a_simulated_sweep_writes_its_table_and_figures(tmp_path):
    out = tmp_path / "out"
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(TINY_SIM.format(base=ROOT / "launch/addchain.toml", out=out))
    res = sweep(str(cfg), "--sim")
    assert res.returncode == 0, res.stderr

    rows = read_csv(out / "results.csv")
    names = ["sync"] + [f"{m}-r{r}-eta{e}" for m in ("april", "async") for r in ("1.5", "2") for e in (0, 2)]
    assert list(rows) == names  # sync is one cell; april and async cross every r and η
    assert all(row["status"] == "ok" and row["backend"] == "sim" and float(row["tokens_per_s"]) > 0
               for row in rows.values())
    assert (rows["sync"]["r"], rows["sync"]["eta"]) == ("1.0", "0")
    for name, row in rows.items():
        if row["eta"] == "0":  # nothing older than the learner's version may be delivered
            assert float(row["off_policy_frac"]) == 0.0, name
    assert float(rows["april-r2-eta2"]["off_policy_frac"]) > 0  # recycled partials carry older tokens
    assert rows["sync"]["reward_mean"] == ""  # the simulator trains nothing

    doc = json.loads((out / "results.json").read_text())
    assert doc["backend"] == "sim" and [r["cell"] for r in doc["rows"]] == names
    for r in doc["rows"]:
        lags = [int(k) for k in r["staleness_tokens"]]
        assert lags and max(lags) <= r["eta"]  # the histogram respects η
    assert any("rewards.png" in note for note in doc["notes"])
    for name in ("throughput_vs_eta.png", "offpolicy_vs_eta.png", "staleness.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    assert not (out / "rewards.png").exists()


@pytest.mark.parametrize("text,named", [
    ('[sweep]\nbase = "{base}"\nmodes = ["sync", "turbo"]\n', "turbo"),
    ('[sweep]\nbase = "{base}"\neta = [1, -1]\n', "eta: -1 is negative"),
    ('[sweep]\nbase = "{tmp}/missing.toml"\n', "missing.toml' does not exist"),
    ('[sweep]\nbase = "{base}"\nr = [0.5]\n', "r: 0.5"),
    ('[sweep]\nbase = "{base}"\nstep = 3\n', "step"),
    ('[sweep]\nbase = "{base}"\n[sim]\ngenerators = 0\n', "[sim] config: generators"),
    ('[sweep]\nbase = "{base}"\n[simulation]\n', "unknown table [simulation]"),
    ('[run]\nx = 1\n', "unknown table [run]"),
    ('[sweep\n', "not valid TOML"),
])
def test_bad_sweep_configs_are_one_line_errors(tmp_path, capsys, text, named):
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(text.format(base=ROOT / "launch/addchain.toml", tmp=tmp_path))
    assert load_tool("sweep").main([str(cfg), "--sim", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_missing_sweep_file_is_a_one_line_error(tmp_path, capsys):
    assert load_tool("sweep").main([str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope.toml' does not exist" in err and len(err.splitlines()) == 1


def _actors_of(out: Path) -> list[int]:
    """Live processes whose command line names ``out``: actors a cell's ``april up`` started."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except (OSError, NotADirectoryError):
            continue
        if entry.name.isdigit() and str(out) in cmd and "april_async.cli" in cmd and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_an_engine_backed_sweep_runs_its_cells_from_one_initial_policy(tmp_path):
    """The sweep's commands for sync and april (``--dry-run``), then one april cell run for real. The
    sweep runs a cell through the experiments' runner (``april_async/experiments/runs.py``: the warm
    start, ``run_up``), which ``test_experiment.py``'s smoke run drives through a sync and an april
    cell; a sync cell's runs deliver no off-policy token there."""
    base = tmp_path / "base.toml"
    base.write_text(TINY_BASE.format(tmp=tmp_path) + "\n" + TINY_POLICY_TOML)
    out = tmp_path / "out"
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(f'[sweep]\nbase = "{base}"\nout = "{out}"\nmodes = ["sync", "april"]\neta = [1]\nr = [2.0]\n'
                   f'steps = 3\n')
    dry = sweep(str(cfg), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dict(line.split(": ", 1) for line in dry.stdout.splitlines() if ": " in line and not line.startswith("sweep"))
    assert list(lines) == ["sync", "april-r2-eta1"], dry.stdout
    for name, (mode, r, eta) in {"sync": ("sync", "1.0", "0"), "april-r2-eta1": ("april", "2.0", "1")}.items():
        for setting in (f'broker.rollout.mode="{mode}"', f"broker.rollout.over_provision={r}",
                        f"broker.rollout.staleness_bound={eta}", "run.max_steps=3"):
            assert setting in lines[name], (name, setting, lines[name])
    assert not out.exists(), "--dry-run wrote something"

    cfg.write_text(cfg.read_text().replace('modes = ["sync", "april"]', 'modes = ["april"]'))
    res = sweep(str(cfg), timeout=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert res.stdout.count("warm start done") == 1

    rows = read_csv(out / "results.csv")
    assert list(rows) == ["april-r2-eta1"]
    for name, row in rows.items():
        assert row["status"] == "ok" and row["backend"] == "engine", row
        assert int(row["steps"]) == 3 and float(row["tokens_per_s"]) > 0 and float(row["groups_per_s"]) > 0, row
        assert 0.0 <= float(row["reward_mean"]) <= 1.0 and float(row["wall_s"]) > 0
        assert 0.0 <= float(row["off_policy_frac"]) <= 1.0, row
        cell = out / "cells" / name
        learner = json.loads((cell / "config" / "learner-0.json").read_text())
        broker = json.loads((cell / "config" / "broker.json").read_text())["rollout"]
        assert Path(learner["checkpoint"]) == (out / "init").resolve()  # the sweep's one warm start
        assert not (cell / "init").exists()
        assert json.loads((cell / "broker_state.json").read_text())["balanced"]
        assert (broker["mode"], broker["over_provision"], broker["staleness_bound"]) == ("april", 2.0, 1)

    doc = json.loads((out / "results.json").read_text())
    for r in doc["rows"]:
        assert len(r["rewards"]) == 3 and max(int(k) for k in r["staleness_tokens"]) <= r["eta"]
    for name in ("throughput_vs_eta.png", "offpolicy_vs_eta.png", "staleness.png", "rewards.png"):
        assert (out / name).read_bytes().startswith(PNG), name
    assert not _actors_of(out), "actors outlived the sweep"
