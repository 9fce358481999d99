"""Where the test suite's CPU goes: a pytest plugin that records each test's CPU time, and a report.

The suite is CPU-bound on a 2-core machine (three workers keep both cores ~91 % busy), so its wall
time follows its CPU time, and most of that is spent in the processes the tests start. Each test's
row counts the CPU of the test process itself and of every child process it waited for (and of
theirs, when they waited for them: ``RUSAGE_CHILDREN``). A process killed and never waited for is not
counted, and a module's pooled processes are counted in the test during which they are reaped.

    bash tools/test.sh -p april_async.testing.suite_cpu            # rows into $APRIL_SUITE_CPU (default below)
    .venv/bin/python -m april_async.testing.suite_cpu [DIR]        # by file, then the costliest tests
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

DIR_ENV = "APRIL_SUITE_CPU"
DEFAULT_DIR = "/tmp/april-suite-cpu"


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of one test, as one row in this worker's file."""
    wall0, (own0, kids0) = time.monotonic(), _cpu()
    yield
    wall1, (own1, kids1) = time.monotonic(), _cpu()
    out = Path(os.environ.get(DIR_ENV, DEFAULT_DIR))
    out.mkdir(parents=True, exist_ok=True)
    row = {"id": item.nodeid, "wall": wall1 - wall0, "own": own1 - own0, "children": kids1 - kids0}
    with open(out / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(directory: Path) -> list[dict]:
    """Every row under ``directory``; ``ValueError`` names a file that holds none (or a bad line)."""
    rows = []
    files = sorted(directory.glob("*.jsonl"))
    if not files:
        raise ValueError(f"{directory}: no *.jsonl rows (run the suite with -p april_async.testing.suite_cpu)")
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
                row["cpu"] = float(row["own"]) + float(row["children"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a row of this plugin ({e})") from None
            rows.append(row)
    return rows


def report(rows: list[dict], top: int = 30) -> str:
    total, wall = sum(r["cpu"] for r in rows), sum(r["wall"] for r in rows)
    lines = [f"{len(rows)} tests: {total:.0f} s of CPU (theirs and their children's), {wall:.0f} s of wall summed"]
    by_file: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        acc = by_file[r["id"].split("::")[0]]
        acc[0] += 1
        acc[1] += r["cpu"]
        acc[2] += r["wall"]
    lines.append(f"by file, the {top} costliest:    CPU s   wall s  tests  share")
    for name, (n, cpu, w) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {cpu:8.1f} {w:8.1f} {n:6d} {100 * cpu / max(total, 1e-9):5.1f} %  {name}")
    lines.append(f"tests, the {top} costliest:      CPU s   wall s")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        lines.append(f"  {r['cpu']:8.1f} {r['wall']:8.1f}  {r['id']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m april_async.testing.suite_cpu", description=__doc__.split("\n")[0])
    p.add_argument("dir", nargs="?", default=os.environ.get(DIR_ENV, DEFAULT_DIR))
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    try:
        print(report(read_rows(Path(args.dir)), args.top))
    except ValueError as e:
        print(f"suite_cpu: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
