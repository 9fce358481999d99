"""The broker's snapshot: a journal written by format 1 still restores, format 2 round-trips, and a
snapshot that cannot be read is a ``BrokerError`` naming the problem.

``tests/data/broker-journal-v1/`` is a journal directory (a snapshot and the log segment after it)
written by the format-1 code, and ``broker-journal-v1.json`` holds the calls that made it and
what the core held at the snapshot and at the end (see ``tests/data/make_broker_journal_v1.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack
import pytest

from april_async.broker.config import RolloutConfig
from april_async.broker.core import SNAPSHOT_FORMAT, BrokerCore, BrokerError, Place, read_snapshot
from april_async.broker.journal import Journal
from april_async.broker.service import replay
from tests.data.make_broker_journal_v1 import state_of as fixture_state_of  # the fixture's view of a core

DATA = Path(__file__).resolve().parents[1] / "data"
V1_DIR = DATA / "broker-journal-v1"
V1 = json.loads((DATA / "broker-journal-v1.json").read_text())


BEFORE_TRAJECTORIES = set(Place) - {Place.STEPPING}
"""The places when the fixture was written (issue 45 added ``stepping``)."""
TRAJECTORY_COUNTERS = ("turns_finished", "observations", "tokens_observed", "turns_demoted", "tokens_demoted",
                       "steps_retried")


def state_of(core: BrokerCore) -> dict:
    """The fixture's view of a core, with token and log-prob arrays as the lists the JSON holds, less
    what issue 45 added, at zero here (the place ``stepping`` and three counters)."""
    state = fixture_state_of(core)
    assert state["places"].pop("stepping") == 0
    assert [state["counters"].pop(k) for k in TRAJECTORY_COUNTERS] == [0] * len(TRAJECTORY_COUNTERS)
    for s in state["samples"].values():
        s["tokens"], s["logprobs"] = list(s["tokens"]), list(s["logprobs"])
        s["spans"] = [list(pair) for pair in s["spans"]]
    return state


def live(state: dict) -> dict:
    """A fixture state as a core holds it today: ended groups and their samples have left the
    ledger (the place counts keep them)."""
    out = dict(state)
    out["samples"] = {sid: s for sid, s in state["samples"].items() if s["place"] not in ("delivered", "retired")}
    out["groups"] = {gid: g for gid, g in state["groups"].items() if g["state"] == "open"}
    return out


def run_calls(core: BrokerCore, calls: list) -> BrokerCore:
    for method, args in calls:
        getattr(core, method)(*args)
    return core


def v1_snapshot() -> bytes:
    return (V1_DIR / "snapshot-000001.bin").read_bytes()


# ---------------------------------------------------------------------------------------------
# A journal written by format 1


def test_the_fixture_is_format_1_and_holds_a_sample_in_every_place():
    assert msgpack.unpackb(v1_snapshot(), strict_map_key=False)["format"] == 1
    assert all(n > 0 for n in V1["at_snapshot"]["places"].values()), V1["at_snapshot"]["places"]
    assert set(V1["at_snapshot"]["places"]) == {p.value for p in BEFORE_TRAJECTORIES}


def test_a_format_1_snapshot_restores_every_sample_counter_and_queue():
    core = BrokerCore.from_bytes(v1_snapshot())
    assert state_of(core) == live(V1["at_snapshot"])
    assert core.audit()["balanced"]
    c = core.counters
    assert c.staleness_tokens == {"0": 8} and c.staleness_samples == {"0": 4}  # integer lags became strings
    assert c.groups_retired == {"reward_error": 1} and c.groups_filtered == {"zero_variance": 1}
    assert core.config == RolloutConfig(**V1["config"])


def test_a_format_1_journal_recovers_as_the_format_1_code_recovered_it(tmp_path):
    shutil.copytree(V1_DIR, tmp_path / "j")
    core, replayed, had_snapshot = replay(Journal(tmp_path / "j"), RolloutConfig(**V1["config"]))
    assert had_snapshot and replayed == len(V1["calls_after_snapshot"])
    assert state_of(core) == live(V1["after_recovery"])
    # Format 1 lost the order in which live samples last moved: the run that wrote the journal
    # restarted two samples in another order than its recovery did. Nothing else differs.
    at_end, recovered = V1["at_end"], V1["after_recovery"]
    assert {k for k in at_end if at_end[k] != recovered[k]} == {"queues"}
    assert at_end["queues"]["recycle"] == recovered["queues"]["recycle"][::-1]


def test_a_format_1_snapshot_restores_what_the_same_calls_make_today():
    """The calls behind the fixture, run by today's code, give the core the old snapshot restores
    (deadlines aside, which the snapshot keeps from the old clock)."""
    fresh = run_calls(BrokerCore(RolloutConfig(**V1["config"])), V1["calls_before_snapshot"])
    restored = BrokerCore.from_bytes(v1_snapshot())
    assert state_of(restored) == state_of(fresh)
    a, b = msgpack.unpackb(restored.to_bytes()), msgpack.unpackb(fresh.to_bytes())
    live = a["queues"].pop("live"), b["queues"].pop("live")
    # Format 1 kept neither where a later lease resumed a sample (``resumed_at``: none restored, so a
    # restored partial's tokens count as mixed for the learner) ...
    resumed = [x.pop("resumed_at", None) for x in a["samples"]], [x.pop("resumed_at", None) for x in b["samples"]]
    assert not any(resumed[0]) and any(resumed[1])
    assert a == b
    # ... nor the order live samples last moved in (restored: by id).
    assert live[0] == sorted(live[1])


def test_a_restored_format_1_snapshot_is_written_back_as_the_current_format():
    blob = BrokerCore.from_bytes(v1_snapshot()).to_bytes()
    assert msgpack.unpackb(blob)["format"] == SNAPSHOT_FORMAT == 2  # string keys only: plain msgpack reads it
    assert state_of(BrokerCore.from_bytes(blob)) == live(V1["at_snapshot"])


# ---------------------------------------------------------------------------------------------
# The current format


def test_the_snapshot_names_every_part_of_the_state():
    snap = msgpack.unpackb(BrokerCore.from_bytes(v1_snapshot()).to_bytes())
    assert next(iter(snap)) == "format"
    assert set(snap) == {"format", "config", "version", "next_ids", "counters", "prompt_ids", "step_groups",
                         "awaiting_version", "groups", "samples", "leases", "scoring", "unacked_batches",
                         "queues", "ended", "assembly", "reopened_for"}
    scored = next(s for s in snap["samples"] if s["place"] == "scored")
    assert {"sample_id", "group_id", "index", "tokens", "logprobs", "spans", "reward",
            "finished_by"} <= set(scored)
    assert set(snap["queues"]) == {"fresh", "recycle", "unscored", "done", "ready", "live"}


def test_round_trip_gives_the_same_state_and_the_same_future():
    """A core and its restored copy answer every later call alike, down to the bytes of the next
    snapshot."""
    before = run_calls(BrokerCore(RolloutConfig(**V1["config"])), V1["calls_before_snapshot"])
    blob = before.to_bytes()
    after = BrokerCore.from_bytes(blob)
    assert after.to_bytes() == blob and state_of(after) == state_of(before)
    for core in (before, after):
        core.rebase_deadlines(100.0)
    before_out, after_out = list(_later_calls(before)), list(_later_calls(after))
    assert before_out == after_out and before.to_bytes() == after.to_bytes()
    assert sum(1 for r in before_out if type(r) is tuple and len(r) == 3) >= 2  # the calls reached new batches


def _later_calls(core: BrokerCore):
    """Drive a core from the fixture's snapshot to a second batch, yielding what each call returns."""
    now = 101.0
    yield from run_steps(core, [("lease", "gen-a", 8, now), ("publish_version", 2, now)])
    for _ in range(6):
        grants = core.lease("gen-a", 8, now)
        yield grants
        for g in grants:
            yield core.finish(g.lease_id, len(g.resume), [60, 61], [-0.5, -0.25], [[core.version, 2]], "stop",
                              now)
        for lid in list(core.leases):
            held = len(core.samples[core.leases[lid].sample_id].tokens)
            yield core.finish(lid, held, [], [], [], "stop", now)
        for t in core.score_lease("scorer-0", 100, now):
            yield core.scored(t.sample_id, t.lease_id, 1.0, now)
        batch = core.pull_batch(now)
        yield plain_batch(batch)
        if batch is not None:
            yield core.publish_version(core.version + 1, now)
        now += 1.0


def plain_batch(batch):
    """A batch as comparable values (its token arrays are numpy arrays, which ``==`` compares elementwise)."""
    if batch is None:
        return None
    return (batch.batch_id, batch.policy_version, [
        (g.group_id, g.prompt_id, list(g.prompt), g.task, g.meta,
         [(s.sample_id, s.reward, s.finish_reason, s.tokens.tolist(), s.logprobs.tolist(), s.spans) for s in g.samples])
        for g in batch.groups])


def run_steps(core: BrokerCore, steps):
    for method, *args in steps:
        yield getattr(core, method)(*args)


# ---------------------------------------------------------------------------------------------
# What is refused


def _current_state() -> dict:
    return msgpack.unpackb(BrokerCore.from_bytes(v1_snapshot()).to_bytes())


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (b"", "snapshot is not readable: Input data was truncated"),
        (b"\x93\x01\x02\x03", "snapshot is not readable: Expected `object`, got `array`"),
        (msgpack.packb({"format": 7}), "snapshot format 7 is not one this broker reads"),
        (msgpack.packb({"version": 3}), "snapshot format None is not one this broker reads"),
        (msgpack.packb({"format": "2"}),
         r"snapshot is not readable: Expected `int \| null`, got `str` - at `\$.format`"),
        (msgpack.packb({"format": 2, "version": 1}),
         r"snapshot \(format 2\) is malformed: Object missing required field"),
        (msgpack.packb({"format": 1, "version": 1}), "snapshot \\(format 1\\) is malformed: no 'counters'"),
    ],
)
def test_an_unreadable_snapshot_is_a_broker_error_naming_the_problem(blob, problem):
    with pytest.raises(BrokerError, match=problem):
        BrokerCore.from_bytes(blob)


def test_a_damaged_snapshot_names_the_field():
    state = _current_state()
    state["samples"][3]["place"] = "lost"
    with pytest.raises(BrokerError, match=r"format 2\) is malformed: .*`\$\.samples\[3\]\.place`"):
        BrokerCore.from_bytes(msgpack.packb(state))
    state = _current_state()
    state["counters"]["staleness_tokens"] = {1: 2}  # an integer key, as format 1 wrote
    with pytest.raises(BrokerError, match=r"`\$\.counters\.staleness_tokens`"):
        BrokerCore.from_bytes(msgpack.packb(state))
    truncated = BrokerCore.from_bytes(v1_snapshot()).to_bytes()[:-10]
    with pytest.raises(BrokerError, match="truncated"):
        BrokerCore.from_bytes(truncated)


def test_a_damaged_format_1_snapshot_names_the_problem():
    old = msgpack.unpackb(v1_snapshot(), strict_map_key=False)
    old["samples"][0] = old["samples"][0][:-1]
    with pytest.raises(BrokerError, match=r"format 1\) is malformed: a record of 11 values where 12"):
        BrokerCore.from_bytes(msgpack.packb(old))


def test_an_inconsistent_snapshot_is_refused():
    state = _current_state()
    state["leases"][0]["sample_id"] = 999
    with pytest.raises(BrokerError, match=r"leases or score requests name unknown samples \[999\]"):
        BrokerCore.from_bytes(msgpack.packb(state))
    state = _current_state()
    state["config"]["batch_groups"] = 0
    with pytest.raises(BrokerError, match="(?s)invalid config.*batch_groups"):
        BrokerCore.from_bytes(msgpack.packb(state))


def test_read_snapshot_gives_the_typed_structure():
    snap = read_snapshot(v1_snapshot())
    assert snap.format == SNAPSHOT_FORMAT and snap.version == V1["at_snapshot"]["version"]
    assert {s.place for s in snap.samples} == BEFORE_TRAJECTORIES
    assert snap.queues.fresh == V1["at_snapshot"]["queues"]["fresh"]
