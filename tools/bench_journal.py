"""Cost per record of the broker's journal, for each durability level, measured in one run.

    .venv/bin/python tools/bench_journal.py           # 20,000 records per case
    .venv/bin/python tools/bench_journal.py --quick   # a smoke run

Records are the size of a journaled 16-token chunk (about 200 bytes). "commit each" writes every
record by itself (the worst case: one message per poll); "group 256" commits 256 at a time, as
the broker does when messages arrive faster than it polls. Snapshot cost is shown for 1 and 16 MiB.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from april_async.broker.journal import Journal  # noqa: E402

RECORD = b"\x92\xa5chunk" + bytes(190)


def per_record_us(durability: str, n: int, group: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        j = Journal(Path(d), durability=durability, interval_s=0.05)
        j.recover()
        start = time.perf_counter()
        for i in range(n):
            j.append(RECORD)
            if (i + 1) % group == 0:
                j.commit()
                j.maybe_flush(time.monotonic())
        j.flush()
        elapsed = time.perf_counter() - start
        j.close()
    return elapsed / n * 1e6


def snapshot_ms(size: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        j = Journal(Path(d))
        j.recover()
        start = time.perf_counter()
        j.snapshot(bytes(size))
        elapsed = time.perf_counter() - start
        j.close()
    return elapsed * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=20_000)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    n = 500 if args.quick else args.records
    print(f"{'durability':<10} {'commit each (us/rec)':>21} {'group 256 (us/rec)':>19}")
    for durability in ("none", "interval", "always"):
        k = max(50, n // 20) if durability == "always" else n
        print(f"{durability:<10} {per_record_us(durability, k, 1):21.2f} {per_record_us(durability, n, 256):19.2f}")
    for mib in (1, 16):
        print(f"snapshot {mib:>2} MiB: {snapshot_ms(mib << 20):8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
