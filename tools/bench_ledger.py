"""The broker's durable state against run length: snapshot bytes, recovery time, memory.

    .venv/bin/python tools/bench_ledger.py                  # 30, 300 and 3,000 learner steps (~2 min)
    .venv/bin/python tools/bench_ledger.py --steps 30,300   # the chaos run's length and 10x it
    .venv/bin/python tools/bench_ledger.py --smoke          # seconds (CI)

A run of the real ``BrokerCore`` with the real write-ahead ``Journal``, driven in process the way
the service drives it (every call journaled as the service journals it, a snapshot every
``--snapshot-every`` records): april mode, two generators taking leases, responses of random
lengths streamed in 16-token chunks, a share of leases aborted by their generator (partials
recycled), scores for everything finished, a batch pulled and a version published whenever
``B`` groups are ready. At each length in ``--steps`` (learner steps, i.e. batches delivered) it
reports:

- **snapshot**: the bytes of ``core.to_bytes()`` at that moment, and how long writing it took;
- **recovery**: a restart's ``replay`` of the journal directory (its newest snapshot, then every
  record after it), timed, and checked to give back the same state;
- **ledger**: the samples and groups the core holds, and the objects the garbage collector tracks
  in this process.

A ledger that keeps what it delivered grows with every step; one that lets ended groups go stays the
size of the work in flight, whatever the run length. ``--check`` (the CI smoke) fails when the
snapshot at the longest length is more than twice the one at the shortest.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from april_async.broker import records as r  # noqa: E402
from april_async.broker.config import RolloutConfig  # noqa: E402
from april_async.broker.core import BrokerCore  # noqa: E402
from april_async.broker.journal import Journal  # noqa: E402
from april_async.broker.service import replay  # noqa: E402


class Driver:
    """The service's part, minus the sockets: every core call goes through ``apply``."""

    def __init__(self, cfg: RolloutConfig, directory: Path, snapshot_every: int, seed: int):
        self.cfg = cfg
        self.journal = Journal(directory, durability="none")
        self.journal.recover()
        self.core = BrokerCore(cfg)
        self.snapshot_every = snapshot_every
        self.since_snapshot = 0
        self.rng = random.Random(seed)
        self.now = 0.0
        self.prompts = 0
        self.last_snapshot_s = 0.0

    def apply(self, record: r.Record):
        result = r.apply(self.core, record)
        self.journal.append(r.encode(record))
        self.since_snapshot += 1
        if self.since_snapshot >= self.snapshot_every:
            self.snapshot()
        return result

    def snapshot(self) -> None:
        t0 = time.perf_counter()
        self.journal.commit()
        self.journal.snapshot(self.core.to_bytes())
        self.last_snapshot_s = time.perf_counter() - t0
        self.since_snapshot = 0

    def round(self) -> None:
        """One round of the cluster: admit, lease, stream, finish or abort, score, pull, publish."""
        cfg, rng = self.cfg, self.rng
        self.now += 0.05
        while self.core.place_counts()["queued"] < 2 * cfg.max_inflight_samples:
            prompt = [1 + (self.prompts * 7 + i) % 200 for i in range(16)]
            self.apply(r.Admit(f"p-{self.prompts}", prompt, self.now, "bench", {}))
            self.prompts += 1
        for gen in ("gen-0", "gen-1"):
            for grant in self.apply(r.Leases(gen, 16, self.now)):
                held = grant.held
                total = min(cfg.max_response_tokens, held + rng.randint(8, cfg.max_response_tokens))
                offset = held
                while offset < total:
                    k = min(16, total - offset)
                    toks = [rng.randrange(1, 200) for _ in range(k)]
                    lps = [-rng.random() for _ in range(k)]
                    if offset + k < total:
                        self.apply(r.Chunk(grant.lease_id, offset, toks, lps, [(self.core.version, k)], self.now))
                    else:
                        reason = "abort" if rng.random() < 0.2 else "stop"
                        self.apply(r.Finish(grant.lease_id, offset, toks, lps, [(self.core.version, k)], reason,
                                            self.now))
                    offset += k
        for task in self.apply(r.ScoreLeases("scorer-0", 1 << 20, self.now)):
            self.apply(r.Scored(task.sample_id, task.lease_id, float(rng.random() < 0.5), self.now))
        batch = self.apply(r.PullBatch(self.now))
        if batch is not None:
            self.apply(r.AckBatches(batch.batch_id))
            self.apply(r.PublishVersion(self.core.version + 1, self.now))


def tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", default="30,300,3000", help="learner steps at which to measure")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--budget", type=int, default=128, help="max_response_tokens")
    p.add_argument("--snapshot-every", type=int, default=20_000, help="records between snapshots (the service's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="seconds: 10 and 40 steps, smaller snapshots")
    p.add_argument("--check", action="store_true", help="exit 1 unless the snapshot stays flat (at most 2x)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.snapshot_every = "10,40", 2_000
    steps = sorted(int(x) for x in args.steps.split(",") if x)
    if not steps or steps[0] < 1:
        print(f"bench_ledger: --steps {args.steps!r}: positive learner step counts", file=sys.stderr)
        return 2
    cfg = RolloutConfig(mode="april", batch_groups=args.batch_groups, group_size=args.group_size,
                        over_provision=2.0, staleness_bound=2, max_response_tokens=args.budget,
                        lease_timeout_s=1e9, score_timeout_s=1e9)
    print(f"april r=2 η=2, B={cfg.batch_groups} × n={cfg.group_size}, responses ≤ {cfg.max_response_tokens} tokens, "
          f"snapshot every {args.snapshot_every} records\n")
    print(f"{'steps':>6} {'samples admitted':>16} {'on ledger':>10} {'snapshot':>10} {'write':>8} "
          f"{'records':>8} {'recovery':>9} {'gc objects':>10}")
    work = Path(tempfile.mkdtemp(prefix="april-ledger-"))
    rows = []
    try:
        d = Driver(cfg, work / "journal", args.snapshot_every, args.seed)
        for target in steps:
            while d.core.counters.batches_delivered < target:
                d.round()
            d.snapshot()  # the state a restart at this length would read; then a stretch of records after it
            snap_bytes = len(d.core.to_bytes())
            write_s = d.last_snapshot_s
            for _ in range(20):
                d.round()
            d.journal.commit()
            d.journal.flush()
            copy = work / f"copy-{target}"
            shutil.copytree(work / "journal", copy)
            t0 = time.perf_counter()
            j = Journal(copy, durability="none")
            restored, replayed, _ = replay(j, cfg)
            recovery_s = time.perf_counter() - t0
            j.close()
            if restored.to_bytes() != d.core.to_bytes():
                print("bench_ledger: the recovered core differs from the running one", file=sys.stderr)
                return 1
            row = {"steps": target, "admitted": d.core.counters.groups_admitted * cfg.group_size,
                   "live": len(d.core.samples), "snapshot_bytes": snap_bytes, "write_s": write_s,
                   "records": replayed, "recovery_s": recovery_s, "gc_objects": tracked_objects()}
            rows.append(row)
            print(f"{target:>6} {row['admitted']:>16,} {row['live']:>10,} {snap_bytes / 1024:>8.0f} K "
                  f"{write_s * 1e3:>6.1f}ms {replayed:>8,} {recovery_s * 1e3:>7.0f}ms {row['gc_objects']:>10,}",
                  flush=True)
            shutil.rmtree(copy)
        d.journal.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first, last = rows[0], rows[-1]
    growth = last["snapshot_bytes"] / first["snapshot_bytes"]
    print(f"\nsnapshot at {last['steps']} steps / at {first['steps']}: {growth:.2f}x "
          f"(run {last['steps'] / first['steps']:.0f}x longer); recovery {last['recovery_s'] / first['recovery_s']:.2f}x")
    if args.check and growth > 2.0:
        print(f"bench_ledger: FAIL: the snapshot grew {growth:.2f}x with the run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
