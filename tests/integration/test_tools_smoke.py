"""Each benchmark runs from a clean checkout with one command and prints its table (smoke size)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_bench_broker_prints_ratios_against_raw():
    lines = run("tools/bench_broker.py", "--quick").splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ("raw", "broker", "broker+journal")}
    assert set(rows) == {"raw", "broker", "broker+journal"}
    assert float(rows["raw"][2]) == 1.0 and all(float(r[1]) > 0 for r in rows.values())


def test_bench_journal_prints_each_durability():
    out = run("tools/bench_journal.py", "--quick")
    assert all(f"\n{d} " in "\n" + out for d in ("none", "interval", "always")) and "snapshot 16 MiB" in out


def test_bench_exit_prints_each_end_and_refuses_bad_rounds():
    rows = [line.split() for line in run("tools/bench_exit.py", "--quick").splitlines() if line.startswith("none ")]
    assert len(rows) == 1 and all(float(x) > 0 for x in rows[0][1:4])  # sys.exit, exit_process, os._exit
    bad = subprocess.run([sys.executable, "tools/bench_exit.py", "--rounds", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--rounds must be at least 1" in bad.stderr


def test_bench_engine_prints_tokens_per_second_by_batch():
    out = run("tools/bench_engine.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line[:3] in ("5M ", "30M")]
    assert [(r[0], int(r[2])) for r in rows] == [("5M", 1), ("5M", 4), ("30M", 1), ("30M", 4)]
    assert "memory bandwidth (a device-to-device copy, read + written)" in out
    for r in rows:  # tokens/s, the bandwidth bound of the step and the step over it
        assert float(r[4]) > 0 and float(r[5]) > 0
        assert float(r[6]) == pytest.approx(float(r[3]) / float(r[5]), rel=0.05, abs=0.1)
    # The bound grows with the model: 30M's weights are ~5x 5M's.
    assert float(rows[2][5]) > 3 * float(rows[0][5])


def test_bench_engine_prints_eager_and_graph_steps_side_by_side():
    """``--cuda-graphs both``: the eager columns, then the graph step's (on the CPU the static-buffer
    step uncaptured) and the speedup, eager ms over graph ms."""
    out = run("tools/bench_engine.py", "--quick", "--models", "5M", "--batches", "2", "--cuda-graphs", "both")
    assert "decode step: eager, then the static-buffer step, uncaptured" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("5M ")]
    assert len(rows) == 1 and len(rows[0]) == 11, rows
    step_ms, graph_ms, speedup = float(rows[0][3]), float(rows[0][7]), float(rows[0][10])
    assert speedup == pytest.approx(step_ms / graph_ms, rel=0.05, abs=0.01)


def test_bench_learner_prints_the_step_at_one_and_two_ranks(tmp_path):
    import json

    run("tools/bench_learner.py", "--smoke", "--json", str(tmp_path / "l.json"))
    summary = json.loads((tmp_path / "l.json").read_text())
    assert [r["ranks"] for r in summary["results"]] == [1, 2]
    assert all(r["step_s"] > 0 and len(r["peak_rss_mb_per_rank"]) == r["ranks"] for r in summary["results"])
    assert summary["results"][1]["max_abs_diff_vs_first"] <= 1e-5  # the same training at 2 ranks


def test_bench_rollout_compares_every_mode_with_sync_and_the_limit(tmp_path):
    out = run("tools/bench_rollout.py", "--smoke", "--json", str(tmp_path / "r.json"))
    assert "no-tail limit" in out
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    rows = data["rows"]
    assert [(r["mode"], r["r"], r["boundary"]) for r in rows] == [
        ("sync", 1.0, "abort"), ("april", 1.5, "abort"), ("april", 1.5, "inflight"), ("april", 2.0, "abort"),
        ("april", 2.0, "inflight"), ("async", 2.0, "abort")]
    sync = rows[0]
    assert sync["vs_sync"] == 1.0 and sync["off_policy"] == 0.0 and sync["recycled"] == 0
    assert all(r["ledger_ok"] and r["tokens_per_s"] > 0 and 0 < r["occupancy"] <= 1.0 for r in rows)
    assert any(r["recycled"] > 0 for r in rows if r["mode"] == "april")  # april recycles partials
    # An inflight boundary keeps its leases decoding: nothing comes back to be prefilled again.
    assert all(r["resumed_per_generated"] == 0 for r in rows if r["boundary"] == "inflight")
    assert all(0 <= r["fill_share"] <= 1 for r in rows)
    assert data["limit"]["tokens_per_s"] > 0 and all(r["vs_limit"] > 0 for r in rows)


def test_bench_ledger_keeps_the_snapshot_flat_as_the_run_grows():
    out = run("tools/bench_ledger.py", "--smoke", "--check")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [10, 40]
    on_ledger = [int(r[2].replace(",", "")) for r in rows]
    admitted = [int(r[1].replace(",", "")) for r in rows]
    assert admitted[1] > 2 * admitted[0] and on_ledger[1] < admitted[0]  # ended groups left the ledger


def test_bench_rollout_refuses_a_bad_setting_naming_it():
    out = subprocess.run([sys.executable, "tools/bench_rollout.py", "--smoke", "--workload", "zipf:a=2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown kind 'zipf'" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_bench_sglang_prints_each_path_against_the_embedded_engine():
    out = run("tools/bench_sglang.py", "--smoke")
    rows = {line[:34].strip(): line[34:].split() for line in out.splitlines() if line.startswith(("embedded", "sglang"))}
    assert set(rows) == {"embedded (in process)", "sglang, streamed (cumulative)", "sglang, streamed (incremental)",
                         "sglang, whole answers"}
    assert float(rows["embedded (in process)"][2]) == 1.0 and all(float(r[1]) > 0 for r in rows.values())
    pushes = [line.split() for line in out.splitlines() if line.startswith("to ")]
    # to 1 and 2 stand-ins, each bucket as one broadcast ("flattened_bucket") and one per tensor
    assert [(p[1], p[6]) for p in pushes] == [("1", "tensor"), ("1", "bucket"), ("2", "tensor"), ("2", "bucket")]
    assert all(float(p[-3]) > 0 and float(p[-1]) > 0 for p in pushes)  # median seconds, ratio to per tensor
