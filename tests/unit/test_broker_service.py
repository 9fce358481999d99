"""The broker service packs a batch a slice per loop turn, journals every slice, and a replay of
the journal at any point (between two slices included) is the live core."""

import numpy as np

from april_async.broker.journal import Journal
from april_async.broker.records import ScoreLeases, Scored
from april_async.broker.service import replay
from april_async.testing.broker_service import T0, Generator, service
from april_async.wire import codec
from april_async.wire import messages as m


def _finish_all(gen: Generator) -> None:
    for g in gen.leases:
        gen.send(m.Finished(lease_id=g.lease_id, sample_id=g.sample_id, offset=0, versions=[m.VersionSpan(0, 2)],
                            tokens=np.asarray([5, 6], np.int32), logprobs=np.asarray([-0.5, -0.25], np.float32),
                            reason="stop"))


def _score_all(svc) -> None:
    for t in svc.apply(ScoreLeases("scorer", 100, T0)):
        svc.apply(Scored(t.sample_id, t.lease_id, 1.0, T0))


def _batches(svc) -> list[m.Batch]:
    return [b for _, b in svc.hub.sent if isinstance(b, m.Batch)]


def test_a_batch_goes_out_a_slice_per_turn_and_every_slice_replays(tmp_path):
    svc = service(tmp_path, rollout={"mode": "async", "batch_groups": 3, "group_size": 2, "over_provision": 2.0,
                                     "max_response_tokens": 64}, prompts={"limit": 6}, batch_slice_samples=2)
    gen = Generator(svc, slots=6)
    _finish_all(gen)
    _score_all(svc)
    for seq, body in enumerate([m.Hello(role="learner", instance="learner", capacity=1),
                                m.BatchRequest(policy_version=0)], start=1):
        svc.handle(b"learner", codec.decode([bytes(f) for f in codec.encode(body, sender="learner", seq=seq)]), T0)
    svc.tick(T0)  # the first of three slices: chosen, one group packed, nothing sent yet
    assert _batches(svc) == [] and svc.core.batch_pending() and svc.core._assembly.packed == 1
    svc.journal.flush()
    middle, _, _ = replay(Journal(tmp_path / "journal"), svc.cfg.rollout)
    assert middle.to_bytes() == svc.core.to_bytes()
    svc.tick(T0)
    svc.tick(T0)
    (batch,) = _batches(svc)
    assert len(batch.groups) == 3 and [len(g.samples) for g in batch.groups] == [2, 2, 2]
    assert batch.response_tokens.tolist() == [5, 6] * 6
    svc.journal.close()
    recovered, replayed, _ = replay(Journal(tmp_path / "journal"), svc.cfg.rollout)
    assert replayed == svc.journal.records_appended
    assert recovered.to_bytes() == svc.core.to_bytes() and recovered.unacked_batches == svc.core.unacked_batches


def _hello(svc, name: str, slots: int) -> None:
    body = m.Hello(role="generator", instance=name, capacity=slots)
    svc.handle(name.encode(), codec.decode([bytes(f) for f in codec.encode(body, sender=name, seq=1)]), T0)


def _leased(svc) -> dict[bytes, int]:
    out: dict[bytes, int] = {}
    for identity, body in svc.hub.sent:
        if isinstance(body, m.Generate):
            out[identity] = out.get(identity, 0) + 1
    return out


def test_a_step_is_spread_over_the_generators_not_piled_on_the_first():
    """Sync, 8 groups of 8 and two generators of 64 slots: 32 leases each, not 64 and 0; generators
    of unequal sizes fill the small ones and put the rest on the large; more work than slots fills all."""
    svc = service(rollout={"mode": "sync", "batch_groups": 8, "group_size": 8, "over_provision": 1.0,
                           "staleness_bound": 0, "max_response_tokens": 64}, prompts={"limit": 64})
    _hello(svc, "gen-0", 64)
    _hello(svc, "gen-1", 64)
    svc.tick(T0)
    assert _leased(svc) == {b"gen-0": 32, b"gen-1": 32}

    svc = service(rollout={"mode": "sync", "batch_groups": 8, "group_size": 8, "over_provision": 1.0,
                           "staleness_bound": 0, "max_response_tokens": 64}, prompts={"limit": 64})
    _hello(svc, "gen-0", 16)
    _hello(svc, "gen-1", 64)
    _hello(svc, "gen-2", 8)
    svc.tick(T0)
    assert _leased(svc) == {b"gen-0": 16, b"gen-1": 40, b"gen-2": 8}  # the small ones full, the rest on the big one

    svc = service(rollout={"mode": "april", "batch_groups": 8, "group_size": 8, "over_provision": 2.0,
                           "max_response_tokens": 64}, prompts={"limit": 128})
    _hello(svc, "gen-0", 40)
    _hello(svc, "gen-1", 40)
    svc.tick(T0)
    assert _leased(svc) == {b"gen-0": 40, b"gen-1": 40}


def test_the_start_log_names_the_allocator(tmp_path):
    """The "serving" line says which malloc the broker runs on and with what settings (its worst
    call times at 1,000 generators depend on it: docs/benchmarks.md)."""
    import gc

    from structlog.testing import capture_logs

    from april_async.broker.allocator import allocator_in_use

    svc = service(tmp_path)
    with capture_logs() as logs:
        try:
            svc.run(stop=True)  # nothing to serve: it logs "serving" and closes
        finally:
            gc.unfreeze()  # run() froze the test process's objects
    (serving,) = [e for e in logs if e["event"] == "serving"]
    assert serving["allocator"] == allocator_in_use()
