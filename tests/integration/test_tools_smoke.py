"""Each benchmark runs from a clean checkout with one command and prints its table (smoke size)."""

import subprocess
import sys
from pathlib import Path

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


def test_bench_engine_prints_tokens_per_second_by_batch():
    rows = [line.split() for line in run("tools/bench_engine.py", "--quick").splitlines() if line[:3] in ("5M ", "30M")]
    assert [(r[0], int(r[2])) for r in rows] == [("5M", 1), ("5M", 4), ("30M", 1), ("30M", 4)]
    assert all(float(r[4]) > 0 for r in rows)
