"""The ``progress`` message (protocol 1.7): its codec, its refusals, and the broker service applying
it entry by entry as token chunks, idempotently, with one journal record per message that replays
to the same state."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from april_async.broker.journal import Journal
from april_async.broker.service import BrokerService, replay
from april_async.wire import codec
from april_async.wire import messages as m
from april_async.testing.broker_service import T0, Generator, entry, service
from april_async.wire.errors import BulkFrameError, MalformedFrame





def progress(*entries: m.ProgressEntry, first_token: int = 0) -> m.Progress:
    n = sum(e.count for e in entries)
    return m.Progress(entries=list(entries), tokens=np.arange(first_token, first_token + n, dtype=np.int32),
                      logprobs=-np.arange(n, dtype=np.float32) / 8)


def wire(body: m.Body, seq: int = 1) -> list[bytes]:
    return [bytes(f) for f in codec.encode(body, sender="gen-0", seq=seq)]


def edited(body: m.Body, edit) -> list[bytes]:
    """The frames of ``body`` with ``edit(plain_body)`` applied to frame 0's body."""
    frames = wire(body)
    env = msgspec.msgpack.decode(frames[0])
    edit(env["body"])
    return [msgspec.msgpack.encode(env), *frames[1:]]


# ---------------------------------------------------------------------------------------------
# The message


def test_round_trip_keeps_every_entry_and_both_arrays():
    body = m.Progress(entries=[m.ProgressEntry(12, 102, 3, 4, [m.VersionSpan(3, 2), m.VersionSpan(4, 2)]),
                               m.ProgressEntry(14, 104, 0, 1, [m.VersionSpan(4, 1)])],
                      tokens=np.asarray([5, 6, 7, 8, 9], dtype=np.int32),
                      logprobs=np.asarray([-0.5, -0.25, -1.0, -2.0, -0.125], dtype=np.float32))
    frames = wire(body)
    assert len(frames) == 3  # the envelope and one bulk frame per array, whatever the entry count
    got = codec.decode(frames).body
    assert isinstance(got, m.Progress) and got.entries == body.entries
    assert got.tokens.tolist() == [5, 6, 7, 8, 9]
    assert got.logprobs.tolist() == [-0.5, -0.25, -1.0, -2.0, -0.125]
    # On the wire an entry is a plain array: [lease_id, sample_id, offset, count, [[version, count], ...]]
    assert msgspec.msgpack.decode(frames[0])["body"]["entries"][0] == [12, 102, 3, 4, [[3, 2], [4, 2]]]


@pytest.mark.parametrize("edit, field, words", [
    (lambda b: b["entries"][1].__setitem__(3, 3), "$.body.entries[1]", "spans cover 2 tokens but count is 3"),
    (lambda b: b["entries"][0].__setitem__(4, [[0, 1], [1, 2]]), "$.body.entries[0]", "spans cover 3"),
    (lambda b: b["entries"][1].__setitem__(2, -1), "$.body.entries[1]", "offset -1"),
    (lambda b: b["entries"][0].__setitem__(3, 0), "$.body.entries[0]", "count 0"),
    (lambda b: b["entries"][1].__setitem__(4, [[-1, 2]]), "$.body.entries[1][4][0]", "version >= 0"),
    (lambda b: b["entries"][0].pop(), "$.body.entries[0]", "at least length 5"),
    (lambda b: b.__setitem__("entries", []), "$.body", "at least one entry"),
    (lambda b: b.__setitem__("entries", b["entries"][:1]), "$.body", "counts sum to 2 but the message has 4"),
    (lambda b: b.pop("entries"), "$.body.entries", "missing required field"),
])
def test_entries_that_do_not_add_up_are_refused_naming_the_problem(edit, field, words):
    frames = edited(progress(entry(1, 0, 2), entry(2, 0, 2)), edit)
    with pytest.raises(MalformedFrame) as err:
        codec.decode(frames)
    assert err.value.field == field and words in err.value.message, err.value


def test_an_entry_with_items_after_the_fifth_is_read_without_them():
    """Room for a later minor version: an entry is a fixed array, but trailing items are ignored."""
    frames = edited(progress(entry(1, 0, 2)), lambda b: b["entries"][0].append({"future": 1}))
    assert codec.decode(frames).body.entries == [entry(1, 0, 2)]


def test_arrays_of_different_lengths_are_refused():
    body = progress(entry(1, 0, 2))
    frames = wire(body)
    frames[2] = frames[2][:4]  # one log-prob, for two tokens
    env = msgspec.msgpack.decode(frames[0])
    env["body"]["logprobs"]["len"] = 1
    with pytest.raises(MalformedFrame, match="equal lengths"):
        codec.decode([msgspec.msgpack.encode(env), *frames[1:]])
    with pytest.raises(BulkFrameError, match="expected 2 x 4"):  # a frame shorter than its reference
        codec.decode([wire(body)[0], frames[1], frames[2]])


def test_the_struct_refuses_what_the_decoder_refuses():
    with pytest.raises(ValueError, match="at least one entry"):
        m.Progress(entries=[], tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="entry counts sum to 2"):
        m.Progress(entries=[entry(1, 0, 2)], tokens=np.zeros(3, np.int32), logprobs=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="spans cover 2 tokens but count is 3"):
        m.ProgressEntry(1, 0, 0, 3, [m.VersionSpan(0, 2)])


# ---------------------------------------------------------------------------------------------
# The broker service (april_async.testing.broker_service drives it in-process)


def held(svc: BrokerService, sample_id: int) -> list[int]:
    return list(svc.core.samples[sample_id].tokens)


def test_each_entry_is_applied_to_its_lease():
    svc = service()
    gen = Generator(svc)
    a, b = gen.leases[0], gen.leases[1]
    gen.send(progress(gen.entry(0, 0, 3), gen.entry(1, 0, 2, version=0)))
    assert held(svc, a.sample_id) == [0, 1, 2] and held(svc, b.sample_id) == [3, 4]
    assert list(svc.core.samples[b.sample_id].logprobs) == [-0.375, -0.5]
    gen.send(progress(gen.entry(0, 3, 1), gen.entry(1, 2, 2), first_token=10))
    assert held(svc, a.sample_id) == [0, 1, 2, 10] and held(svc, b.sample_id) == [3, 4, 11, 12]
    assert svc.core.counters.tokens_generated == 8


def test_a_resent_progress_is_a_counted_no_op_per_entry():
    svc = service()
    gen = Generator(svc)
    body = progress(gen.entry(0, 0, 3), gen.entry(1, 0, 2))
    gen.send(body)
    before = (svc.core.to_bytes(), svc.core.counters.tokens_generated)
    gen.send(body)  # the same message again, with a new seq (as after a reconnect): the hub lets it through
    c = svc.core.counters
    assert c.tokens_generated == before[1] == 5 and c.tokens_duplicate == 5
    assert held(svc, gen.leases[0].sample_id) == [0, 1, 2]
    # An overlap appends only the tail, and counts the rest as duplicates.
    gen.send(progress(gen.entry(0, 1, 4), first_token=1))
    assert held(svc, gen.leases[0].sample_id) == [0, 1, 2, 3, 4] and c.tokens_duplicate == 7


def test_one_entry_s_fate_does_not_change_another_s():
    svc = service()
    gen = Generator(svc)
    c = svc.core.counters
    gen.send(progress(entry(999, 0, 2), gen.entry(0, 5, 2), gen.entry(1, 0, 2)))  # stale lease, a gap, good
    assert c.stale_reports == 1 and c.chunk_gaps == 1 and c.tokens_generated == 2
    assert held(svc, gen.leases[1].sample_id) == [4, 5]


def test_a_progress_is_exactly_its_entries_sent_as_token_chunks():
    """Two services, one fed ``progress`` messages, one the same tokens as ``token_chunk``s, end in
    the same state, down to the bytes of their snapshots."""
    flushes = [[(0, 0, 3, 0), (1, 0, 2, 0), (2, 0, 4, 1)],  # (lease index, offset, count, version)
               [(0, 3, 2, 1), (1, 2, 2, 1)],
               [(0, 0, 5, 0), (3, 0, 1, 2)]]
    by_progress, by_chunks = service(), service()
    gp, gc = Generator(by_progress), Generator(by_chunks)
    first = 0
    for flush in flushes:
        body = progress(*(gp.entry(i, off, n, v) for i, off, n, v in flush), first_token=first)
        gp.send(body)
        pos = 0
        for e in body.entries:
            end = pos + e.count
            gc.send(m.TokenChunk(lease_id=e.lease_id, sample_id=e.sample_id, offset=e.offset,
                                 versions=e.versions, tokens=body.tokens[pos:end],
                                 logprobs=body.logprobs[pos:end]))
            pos = end
        first += 100
    assert by_progress.core.to_bytes() == by_chunks.core.to_bytes()
    assert by_progress.core.counters.as_dict() == by_chunks.core.counters.as_dict()
    assert by_progress.core.counters.tokens_duplicate == 5


def test_one_journal_record_per_message_replays_to_the_same_state(tmp_path):
    svc = service(tmp_path)
    gen = Generator(svc)
    appended = svc.journal.records_appended
    gen.send(progress(gen.entry(0, 0, 3), gen.entry(1, 0, 2), gen.entry(2, 0, 1, version=1)))
    assert svc.journal.records_appended == appended + 1
    gen.send(progress(gen.entry(0, 0, 3)))  # a duplicate
    gen.send(progress(entry(999, 0, 1), gen.entry(3, 4, 1)))  # stale and a gap
    gen.send(m.WeightsPublished(version=1))
    gen.send(progress(gen.entry(0, 3, 2, version=1), gen.entry(1, 2, 3, version=1), first_token=50))
    g = gen.leases[2]
    gen.send(m.Finished(lease_id=g.lease_id, sample_id=g.sample_id, offset=1, versions=[m.VersionSpan(1, 1)],
                        tokens=np.asarray([7], np.int32), logprobs=np.asarray([-0.5], np.float32),
                        reason="stop"))
    svc.tick(T0)
    svc.journal.close()
    recovered, replayed, _ = replay(Journal(tmp_path / "journal"), svc.cfg.rollout)
    assert replayed == svc.journal.records_appended
    assert recovered.to_bytes() == svc.core.to_bytes()
    assert recovered.counters.as_dict() == svc.core.counters.as_dict()
    assert list(recovered.samples[gen.leases[1].sample_id].logprobs) == [-0.375, -0.5, -0.25, -0.375, -0.5]


def test_replay_after_a_snapshot_takes_the_progress_records_after_it(tmp_path):
    svc = service(tmp_path)
    gen = Generator(svc)
    gen.send(progress(gen.entry(0, 0, 3), gen.entry(1, 0, 2)))
    svc.journal.snapshot(svc.core.to_bytes())
    gen.send(progress(gen.entry(0, 3, 2), gen.entry(1, 0, 4), first_token=20))
    svc.journal.close()
    recovered, replayed, had_snapshot = replay(Journal(tmp_path / "journal"), svc.cfg.rollout)
    assert had_snapshot and replayed == 1
    assert recovered.to_bytes() == svc.core.to_bytes()
