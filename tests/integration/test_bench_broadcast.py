"""``tools/bench_broadcast.py`` from a clean checkout: its smoke run starts a real broadcaster, a real
member and raw gloo ranks, writes positive figures for its size, and leaves no process behind; bad
input is a one-line error with exit code 2 (the exit code from a real process once; each refusal
from the tool's ``main``, in this process, so that none pays for a process importing torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from april_async.testing.procs import load_tool

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("effective_gb_s", "effective_total_gb_s", "raw_flat_gb_s", "raw_bucketed_gb_s", "fanout_gb_s",
           "effective_over_raw", "fanout_over_raw_bucketed", "stall_s", "copy_s", "stall_over_copy",
           "stall_over_copy_of_minima")


def bench(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/bench_broadcast.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def ours_alive(pid: int) -> bool:
    """Whether ``pid`` is still one of the benchmark's children (a broadcaster, member or raw rank)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "bench_broadcast" in cmdline or "april_async.cli" in cmdline


def test_smoke_writes_positive_figures_for_its_size_and_leaves_no_process(tmp_path):
    out = tmp_path / "bench.json"
    run = bench("--smoke", "--json", str(out), "--logs", str(tmp_path / "logs"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "eff/raw" in run.stdout and "stall/copy" in run.stdout
    goals = run.stdout.split("goals (issue 18)")[1].strip().splitlines()[1:]
    assert [g.split()[0] for g in goals] == ["1M"]  # one verdict line per size
    assert all(g.count("pass") + g.count("FAIL") == 2 for g in goals), goals
    data = json.loads(out.read_text())
    assert set(data["sizes"]) == {"1M"}
    for size, r in data["sizes"].items():
        bad = {k: r[k] for k in FIGURES if not (isinstance(r[k], float) and r[k] > 0)}
        assert not bad, f"{size}: figures not positive: {bad}"
        assert r["verified"] and r["k"] == 1 and r["bytes"] > 0
        assert [v["version"] for v in r["versions"]] == [1, 2, 3] and r["versions"][0]["warmup"]
        assert len(r["raw"]["flat_s"]) == len(r["raw"]["bucketed_s"]) == 2
    # per size: two raw ranks, a broker, a broadcaster and a member
    assert len(data["pids"]) == 5
    assert not [pid for pid in data["pids"] if ours_alive(pid)]


@pytest.mark.parametrize("args, names", [
    (["--sizes", "30M,7M"], "'7M'"),
    (["--k", "0"], "--k"),
    (["--member-threads", "0"], "--member-threads"),
    pytest.param(["--backend", "nccl"], "nccl", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="checks the error where CUDA is absent")),
])
def test_bad_input_is_a_one_line_error_with_exit_code_2(args, names, capsys):
    assert load_tool("bench_broadcast").main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_broadcast: ") and names in lines[0], err
    assert out == ""


def test_a_refusal_exits_the_process_with_code_2():
    run = bench("--sizes", "30M,7M", timeout_s=60)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert len(lines) == 1 and lines[0].startswith("bench_broadcast: ") and "'7M'" in lines[0], run.stderr
