"""Golden journals of earlier formats recover exactly: the same state, byte for byte.

``tests/data/journal_golden/`` holds journal directories written by the broker of commit a0df07c
(journal records of format 1, ``[method, args]``; snapshots of format 2), and ``expected.json``
what that code recovered from them and from ``tests/data/broker-journal-v1`` (snapshot format 1).
``tools/make_journal_golden.py`` wrote them once and says how.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import msgpack
import msgspec
import pytest

from april_async.broker.config import RolloutConfig
from april_async.broker.journal import Journal
from april_async.broker.service import replay

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "journal_golden"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
JOURNALS = ["records", "snapshot", "../broker-journal-v1"]
EVERY_CALL = {"admit", "refuse_prompt", "lease", "chunk", "progress", "finish", "score_lease", "scored",
              "score_failed", "requeue_score", "reclaim", "peer_gone", "publish_version", "pull_batch",
              "report_batch", "ack_batches"}
"""Every journaled call when the goldens were written."""
LATER_CALLS = {"observed"}  # issue 45: a trajectory's observation
NEW_COUNTERS = ("turns_finished", "observations", "tokens_observed", "turns_demoted",  # issue 45, 0 here
                "tokens_demoted", "steps_retried")
NEW_CONFIG = {"environments": [], "max_turns": 8, "turn_tokens": None,  # issue 45, at their defaults
              "turn_stop_token_ids": [], "on_env_failure": "retire", "env_retries": 2, "max_context_tokens": None}


def recover(name: str, tmp_path: Path):
    copy = tmp_path / "j"  # recovery opens the last segment for appends: a copy, never the fixture
    shutil.copytree(GOLDEN / name, copy)
    return replay(Journal(copy, durability="none"), RolloutConfig(**EXPECTED[name]["config"]))


@pytest.mark.parametrize("name", JOURNALS)
def test_a_golden_journal_recovers_exactly_what_its_code_recovered(name, tmp_path):
    core, replayed, had_snapshot = recover(name, tmp_path)
    want = EXPECTED[name]
    # Less what issue 45 added, at zero here: the place "stepping" and three counters.
    places = core.place_counts()
    assert places.pop("stepping") == 0
    audit = core.audit()
    audit["places"].pop("stepping")
    counters = json.loads(json.dumps(core.counters.as_dict()))
    assert [counters.pop(k) for k in NEW_COUNTERS] == [0] * len(NEW_COUNTERS)
    got = {
        "records_replayed": replayed, "had_snapshot": had_snapshot, "version": core.version,
        "audit": audit, "places": places,
        "counters": counters,
        "leases": sorted(core.leases), "scoring": sorted(core.scoring),
        "unacked_batches": sorted(core.unacked_batches),
        "assembly": None if core._assembly is None else core._assembly.batch_id,
    }
    assert got == {k: want[k] for k in got}
    # Byte for byte, less ``resumed_at`` (where a lease resumed a sample: recorded since 2026-11-26,
    # after these goldens; replaying their lease records fills it in) and the config's
    # ``async_admission`` (a field since 2026-11-26, at its default here). A snapshot re-encoded
    # without them is the one their code wrote.
    plain = msgspec.msgpack.decode(core.to_bytes())
    assert plain["config"].pop("async_admission") == "continuous"
    assert {k: plain["config"].pop(k) for k in NEW_CONFIG} == NEW_CONFIG
    assert plain.pop("reopened_for") is None  # issue 45's property run: an async report reopens once
    assert [plain["counters"].pop(k) for k in NEW_COUNTERS] == [0] * len(NEW_COUNTERS)
    assert hashlib.sha256(msgspec.msgpack.encode(_without_resumes(plain))).hexdigest() == want["sha256"]
    for sample in core.samples.values():
        assert list(sample.resumed_at) == sorted(set(sample.resumed_at)) and all(k > 0 for k in sample.resumed_at)


def _without_resumes(x):
    if isinstance(x, dict):
        return {k: _without_resumes(v) for k, v in x.items() if k != "resumed_at"}
    if isinstance(x, list):
        return [_without_resumes(v) for v in x]
    return x


def test_the_golden_records_hold_every_kind_of_journaled_call(tmp_path):
    shutil.copytree(GOLDEN / "records", tmp_path / "j")
    snapshot, records = Journal(tmp_path / "j").recover()
    assert snapshot is None
    assert {msgpack.unpackb(r, raw=False)[0] for r in records} == EVERY_CALL


def test_the_golden_snapshot_was_taken_while_a_batch_was_packed():
    from april_async.broker.core import read_snapshot

    snap = read_snapshot((GOLDEN / "snapshot" / "snapshot-000001.bin").read_bytes())
    assert snap.format == 2 and snap.assembly is not None and len(snap.assembly.packed) == 1


# ---------------------------------------------------------------------------------------------
# The record format: one typed record per journaled call, format 1 still read


def test_every_journaled_call_has_one_record_type_named_by_its_call():
    from april_async.broker import records

    assert {t.__struct_config__.tag for t in records.Record.__args__} == EVERY_CALL | LATER_CALLS


def test_a_format_1_record_decodes_as_the_record_of_its_call(tmp_path):
    from april_async.broker import records

    shutil.copytree(GOLDEN / "records", tmp_path / "j")
    _, data = Journal(tmp_path / "j").recover()
    for raw in data:
        method, args = msgpack.unpackb(raw, raw=False)
        record = records.decode(raw)
        assert record.__struct_config__.tag == method
        assert [getattr(record, f) for f in record.__struct_fields__][:len(args)] == args
        again = records.decode(records.encode(record))  # and reads back from format 2 as the same call
        assert type(again) is type(record) and records.encode(again) == records.encode(record)


def test_a_record_of_no_known_call_is_refused_by_name():
    from april_async.broker import records

    with pytest.raises(records.RecordError, match="'expire'"):
        records.decode(msgpack.packb(["expire", [1.0]]))
    with pytest.raises(records.RecordError, match="malformed"):
        records.decode(msgspec.msgpack.encode({"type": "admit", "prompt_id": 3}))


@pytest.mark.parametrize("name", ["records", "snapshot"])
def test_a_golden_journal_continued_in_the_new_format_recovers_as_the_live_core(name, tmp_path):
    """An upgraded broker appends format-2 records to the segment its predecessor wrote in format 1;
    a recovery reads both, in order."""
    from april_async.broker import records as r

    core, _, _ = recover(name, tmp_path)  # recovery opened tmp_path/j's last segment for appends
    journal = Journal(tmp_path / "j", durability="none")
    journal.recover()
    now = 20.0
    calls = [r.PublishVersion(core.version + 1, now), r.Leases("gen-z", 4, now), r.Admit("new", [4, 5], now)]
    for record in calls:
        result = r.apply(core, record)
        journal.append(r.encode(record))
        if isinstance(result, list) and result and isinstance(record, r.Leases):
            g = result[0]
            finish = r.Finish(g.lease_id, g.held, [9, 9], [-0.5, -0.5], [(core.version, 2)], "stop", now)
            r.apply(core, finish)
            journal.append(r.encode(finish))
    journal.close()
    recovered, replayed, _ = replay(Journal(tmp_path / "j", durability="none"),
                                    RolloutConfig(**EXPECTED[name]["config"]))
    assert replayed == EXPECTED[name]["records_replayed"] + 4
    assert recovered.to_bytes() == core.to_bytes() and recovered.audit()["balanced"]
