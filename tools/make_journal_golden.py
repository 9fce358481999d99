"""Golden broker journals: directories a broker left on disk, pinned so that every later code recovers them.

    .venv/bin/python tools/make_journal_golden.py          # refuses to overwrite what is there
    .venv/bin/python tools/make_journal_golden.py --force  # only to add a journal of a NEW format

Each directory under ``tests/data/journal_golden/`` is a journal as ``april_async/broker/journal.py``
lays it out. Its records are written in journal record format 1, the positional ``[method, args]``
MessagePack arrays the service wrote up to issue 26 (``msgpack.packb([method, list(args)])``, and
``["progress", [entries, token bytes, log-prob bytes, now]]`` for a ``progress`` message), with the
argument types the service passed; the snapshots are snapshot format 2. The calls drive an
``april`` core (B = 2, n = 2, r = 2, η = 1) through every kind of journaled call: admit (and a
duplicate), refuse_prompt, lease, chunk, progress, finish (stop, length, abort, error),
score_lease, scored, score_failed, requeue_score, reclaim, peer_gone, publish_version, pull_batch
(whole and in slices, one that packs nothing), report_batch and ack_batches.

- ``records/``: no snapshot, one log segment with every call from the start;
- ``snapshot/``: the same calls with a snapshot taken while a batch is being packed in slices and
  another is unacknowledged, then the log segment after it.

``expected.json`` holds, for each directory (and for ``tests/data/broker-journal-v1``, snapshot
format 1), what the code that wrote it recovered: the sha256 of the recovered core's ``to_bytes()``,
its audit, place counts, counters and version (``tests/unit/test_journal_golden.py`` checks them).
The journals were written once, by the code of commit a0df07c; regenerating them with later code
would pin that code's behaviour instead, so the script refuses unless told ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from april_async.broker.config import RolloutConfig  # noqa: E402
from april_async.broker.core import BrokerCore  # noqa: E402
from april_async.broker.journal import Journal  # noqa: E402
from april_async.broker.service import replay  # noqa: E402

OUT = ROOT / "tests" / "data" / "journal_golden"
V1_DIR = ROOT / "tests" / "data" / "broker-journal-v1"
V1_CONFIG = {"mode": "april", "batch_groups": 2, "group_size": 2, "over_provision": 2.0, "staleness_bound": 1,
             "max_response_tokens": 8, "lease_timeout_s": 10.0, "score_timeout_s": 20.0}
CONFIG = {"mode": "april", "batch_groups": 2, "group_size": 2, "over_provision": 2.0, "staleness_bound": 1,
          "max_response_tokens": 8, "max_attempts": 3, "lease_timeout_s": 10.0, "score_timeout_s": 20.0}
READONLY_CALLS = ("lease", "score_lease")  # the service journals these only when they return something


def recovered_state(core: BrokerCore, replayed: int, had_snapshot: bool) -> dict:
    """What a recovery must give back, in a form JSON keeps exactly."""
    return {
        "sha256": hashlib.sha256(core.to_bytes()).hexdigest(),
        "records_replayed": replayed,
        "had_snapshot": had_snapshot,
        "version": core.version,
        "audit": core.audit(),
        "places": core.place_counts(),
        "counters": json.loads(json.dumps(core.counters.as_dict())),
        "leases": sorted(core.leases),
        "scoring": sorted(core.scoring),
        "unacked_batches": sorted(core.unacked_batches),
        "assembly": None if core._assembly is None else core._assembly.batch_id,
    }


class Writer:
    """Drives a core and journals each call as the service of record format 1 journaled it."""

    def __init__(self, directory: Path, snapshot_at: int | None):
        self.journal = Journal(directory, durability="none")
        self.journal.recover()
        self.core = BrokerCore(RolloutConfig(**CONFIG))
        self.snapshot_at = snapshot_at
        self.calls = 0
        self.mid_batch = 0

    def _record(self, record: list) -> None:
        self.journal.append(msgpack.packb(record, use_bin_type=True))
        self.calls += 1
        if self.calls == self.snapshot_at:
            self.journal.snapshot(self.core.to_bytes())

    def call(self, method: str, *args):
        result = getattr(self.core, method)(*args)
        if method not in READONLY_CALLS or result:
            self._record([method, list(args)])
        return result

    def progress(self, entries: list, tokens: list[int], logprobs: list[float], now: float) -> None:
        """A ``progress`` message: each entry a chunk of its slice; one record, as the service wrote it."""
        tok = np.asarray(tokens, dtype="<i4")
        lp = np.asarray(logprobs, dtype="<f4")
        pos = 0
        for lease_id, _, offset, count, spans in entries:
            self.core.chunk(lease_id, offset, tok[pos:pos + count].tolist(), lp[pos:pos + count].astype(float).tolist(),
                            spans, now)
            pos += count
        self._record(["progress", [entries, tok.tobytes(), lp.tobytes(), now]])


def drive(w: Writer) -> None:
    call = w.call

    def finish(lease_id, offset, n, version, reason, now):
        return call("finish", lease_id, offset, [40 + k for k in range(n)], [-0.5 - k / 8 for k in range(n)],
                    [[version, n]] if n else [], reason, now)

    for i in range(9):
        call("admit", f"p{i}", [1, 2 + i, 3], 0.0, "math", {"answer": str(i)})
    call("admit", "p0", [1, 2, 3], 0.0, "math", {})  # a duplicate prompt
    call("refuse_prompt", "too-long")
    a = call("lease", "gen-a", 4, 1.0)  # g0, g1
    b = call("lease", "gen-b", 4, 1.0)  # g2, g3
    call("chunk", b[0].lease_id, 0, [30, 31, 32], [-1.0, -1.25, -1.5], [[0, 3]], 1.5)
    w.progress([[a[0].lease_id, a[0].sample_id, 0, 2, [[0, 2]]], [b[1].lease_id, b[1].sample_id, 0, 1, [[0, 1]]]],
               [60, 61, 62], [-0.25, -0.5, -0.75], 1.6)
    finish(a[0].lease_id, 2, 0, 0, "stop", 2.0)
    for g in a[1:]:
        finish(g.lease_id, 0, 2, 0, "stop", 2.0)  # g0 and g1 done: the rest is aborted
    finish(b[0].lease_id, 3, 1, 0, "abort", 2.5)  # a partial of 4 tokens
    finish(b[1].lease_id, 1, 0, 0, "abort", 2.5)  # a partial of 1
    for t in call("score_lease", "scorer-0", 4, 3.0):
        call("scored", t.sample_id, t.lease_id, 1.0 if t.sample_id % 2 else 0.0, 3.0)
    batch = call("pull_batch", 3.5, 512)
    call("report_batch", batch.batch_id, 1, [batch.groups[1].group_id], "zero_variance")
    call("publish_version", 1, 4.0)
    call("ack_batches", batch.batch_id)
    c = call("lease", "gen-c", 6, 4.0)  # the two partials of g2 first, then g4 and g5
    finish(c[0].lease_id, 4, 2, 1, "stop", 4.5)
    finish(c[1].lease_id, 1, 2, 1, "stop", 4.5)  # g2 done
    finish(b[2].lease_id, 0, 2, 0, "stop", 5.0)  # an aborting lease that still finished
    call("chunk", c[2].lease_id, 0, [50, 51], [-0.25, -0.75], [[1, 2]], 5.0)
    finish(c[3].lease_id, 0, 8, 1, "length", 5.0)
    finish(c[4].lease_id, 0, 1, 1, "stop", 5.0)
    t = call("score_lease", "scorer-0", 1, 5.5)[0]
    call("scored", t.sample_id, t.lease_id, 0.5, 5.5)
    call("score_lease", "scorer-1", 1, 5.5)  # stays out for scoring
    tasks = call("score_lease", "scorer-0", 3, 5.5)
    call("score_failed", tasks[2].sample_id, tasks[2].lease_id, 5.5, "reward_error")  # retires g5
    call("requeue_score", tasks[0].sample_id)  # finished, waiting for a scorer
    call("reclaim", c[2].lease_id)  # a partial that keeps its 2 tokens
    d = call("lease", "gen-d", 3, 6.0)
    call("peer_gone", "gen-d", 6.2)  # its leases come back as partials
    e = call("lease", "gen-e", 8, 6.5)
    finish(e[-1].lease_id, 0, 0, 1, "error", 6.6)  # the engine refused it: its group retires
    for x in e[:-1]:
        finish(x.lease_id, 0, 2, 1, "stop", 7.0)
    call("peer_gone", "scorer-1", 7.4)  # its score request goes back to the queue
    call("peer_gone", "scorer-0", 7.4)
    for t in call("score_lease", "scorer-2", 8, 7.5):
        call("scored", t.sample_id, t.lease_id, float(t.sample_id % 3), 7.5)
    call("pull_batch", 8.0, 1)  # packs one group of two: the batch is not out yet
    w.mid_batch = w.calls  # the snapshot's place in ``snapshot/``
    call("pull_batch", 8.1, 1)  # the second group: the batch is out, unacknowledged
    call("pull_batch", 8.2, 1)  # nothing ready: journaled all the same, as the service did
    call("publish_version", 3, 9.0)  # restarts the samples holding v0 tokens (η = 1)
    f = call("lease", "gen-f", 2, 9.5)
    w.progress([[f[0].lease_id, f[0].sample_id, 0, 2, [[3, 2]]]], [70, 71], [-0.125, -0.375], 9.6)
    finish(f[0].lease_id, 2, 1, 3, "stop", 9.7)
    del d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--force", action="store_true", help="overwrite the golden journals")
    args = p.parse_args()
    if OUT.exists() and not args.force:
        print(f"{OUT} exists: golden journals are written once (see the docstring)", file=sys.stderr)
        return 1
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    expected: dict = {"config": CONFIG}
    counting = Writer(OUT / "records", snapshot_at=None)
    drive(counting)
    counting.journal.close()
    snapped = Writer(OUT / "snapshot", snapshot_at=counting.mid_batch)
    drive(snapped)
    snapped.journal.close()
    for name, directory, config in [("records", OUT / "records", CONFIG), ("snapshot", OUT / "snapshot", CONFIG),
                                    ("../broker-journal-v1", V1_DIR, V1_CONFIG)]:
        copy = OUT / "copy.tmp"  # recovery opens the last segment for appends: recover a copy
        shutil.copytree(directory, copy)
        try:
            core, replayed, had_snapshot = replay(Journal(copy, durability="none"), RolloutConfig(**config))
        finally:
            shutil.rmtree(copy)
        expected[name] = recovered_state(core, replayed, had_snapshot)
        expected[name]["config"] = config
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    for name in ("records", "snapshot"):
        print(name, expected[name]["places"], expected[name]["records_replayed"], "records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
