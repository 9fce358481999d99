"""A generator that keeps missing versions is reported, not left to stall the run quietly: the
broadcaster's planner counts each member's rounds in a row without the version."""

from __future__ import annotations

import torch

from april_async.broadcaster.config import BroadcasterConfig
from april_async.broadcaster.rounds import CollectiveResult, Log, RoundPlanner, Sever, StartCollective
from april_async.weights.flat import bucket_digests, flatten

CONFIG = BroadcasterConfig(timeout_s=2.0, bucket_mb=64 / (1 << 20), report_failing_after=3)


def held(p: RoundPlanner, version: int, now: float) -> None:
    specs, buf = flatten({"w": torch.arange(50, dtype=torch.float32) + version})
    p.update("learner-0", version, specs, buf.numel(), None, now)
    p.digested(version, bucket_digests(buf, CONFIG.bucket_bytes), now)


def one_round(p: RoundPlanner, version: int, now: float, acks: dict[str, int]) -> list[Log]:
    """Hold ``version``, run its round; each generator answers with the version in ``acks``."""
    for g in acks:
        p.touch(g, now)
    held(p, version, now)
    effects = p.tick(now)
    assert any(isinstance(e, StartCollective) for e in effects), effects
    p.collective_finished(now + 0.1, CollectiveResult(join_s=0.0, bcast_s=0.1, failed=None))
    for g, v in acks.items():
        p.heartbeat(g, v, now + 0.2)
    return [e for e in p.tick(now + 0.3) if isinstance(e, Log)]


def planner(*generators: str) -> RoundPlanner:
    """A planner with a learner and ``generators``, each holding version 0."""
    p = RoundPlanner(CONFIG, backend="gloo", store="127.0.0.1:29600", epoch_id="e")
    p.hello("learner-0", "learner", 0, [], 0.0)
    for g in generators:
        p.hello(g, "generator", 0, [], 0.0)
    return p


def test_a_member_missing_rounds_in_a_row_is_reported_and_its_recovery_too():
    p = planner("gen-0", "gen-1")
    now, reported = 0.0, []
    for v in (1, 2, 3):
        now += 10.0  # past every retry delay
        logs = one_round(p, v, now, {"gen-0": v, "gen-1": 0})  # gen-1's receive fails every time
        reported += [e for e in logs if e.event == "member_failing"]
        assert p.status()["failing"] == ({"gen-1": 3} if v == 3 else {})
    (warning,) = reported
    assert warning.level == "warning" and warning.fields["member"] == "gen-1" and warning.fields["rounds"] == 3
    assert warning.fields["why"] == "refused"

    logs = one_round(p, 4, now + 10.0, {"gen-0": 4, "gen-1": 4})
    assert [e.fields["member"] for e in logs if e.event == "member_recovered"] == ["gen-1"]
    assert p.status()["failing"] == {}


def test_a_failed_collective_counts_against_every_member():
    p = planner("gen-0")
    now = 0.0
    for v in (1, 2, 3):
        now += 10.0
        p.touch("gen-0", now)
        held(p, v, now)
        assert any(isinstance(e, StartCollective) for e in p.tick(now))
        p.collective_finished(now + 0.1, CollectiveResult(join_s=0.0, bcast_s=0.0, failed="gloo: connection reset"))
        p.heartbeat("gen-0", 0, now + 0.2)
        logs = [e for e in p.tick(now + 0.3) if isinstance(e, Log)]
    (failing,) = [e for e in logs if e.event == "member_failing"]
    assert failing.fields["why"] == "the collective failed" and p.status()["failing"] == {"gen-0": 3}


def test_a_member_that_keeps_failing_is_benched_for_longer_each_time():
    p = planner("gen-0", "gen-1")
    now, benched = 0.0, []
    for v in (1, 2, 3, 4):
        now += 100.0  # past every retry delay and bench
        logs = one_round(p, v, now, {"gen-0": v, "gen-1": 0})
        benched += [e.fields["for_s"] for e in logs if e.event == "member_benched"]
    fresh = CONFIG.link.peer_timeout_s / 2
    assert benched == [fresh, 2 * fresh]  # from report_failing_after (3) rounds in a row on, doubling
    assert p.benched["gen-1"] > now and "gen-1" not in p._members(now + 1.0)


def test_a_member_gone_while_the_collective_runs_is_not_waited_for():
    """Issue 29: a network cut took a member away mid-broadcast, and the collective (with every
    other member and the learner) waited for it until the cut ended. Its session expiring now
    cuts the collective (``Sever``); one that acked already, or a round whose collective is over,
    is left alone."""
    p = planner("gen-0", "gen-1")
    held(p, 1, 1.0)
    assert any(isinstance(e, StartCollective) for e in p.tick(1.0))
    p.heartbeat("gen-0", 1, 1.1)  # acked early (a member reports after its own receive)
    assert not [e for e in p.expired("gen-0", 1.2) if isinstance(e, Sever)]
    (sever,) = [e for e in p.expired("gen-1", 4.0) if isinstance(e, Sever)]
    assert sever.member == "gen-1" and sever.reason == "silent"
    p.collective_finished(4.1, CollectiveResult(join_s=0.0, bcast_s=0.0, failed="gloo: connection reset"))
    p.hello("gen-1", "generator", 0, [], 5.0)
    assert not [e for e in p.bye("gen-1", "shutdown", 5.1) if isinstance(e, Sever)], "the collective is over"


def test_a_member_not_at_the_rendezvous_in_time_is_given_up_and_benched_for_longer_each_time():
    """After a cut a returning generator's worker may still sit in an old collective: the epoch
    re-formed for it must not wait ``timeout_s`` on it, nor must the learner."""
    p = planner("gen-0", "gen-1")
    benched = []
    now = 0.0
    for v in (1, 2):
        now += 100.0
        for g in ("gen-0", "gen-1"):
            p.touch(g, now)
        held(p, v, now)
        assert any(isinstance(e, StartCollective) and e.rejoin for e in p.tick(now))
        assert not p.admission_due(now + p.admit_s / 2)
        assert p.admission_due(now + p.admit_s)
        assert p.rendezvous_spec().epoch == p.round.epoch and p.rendezvous_spec().rank == 0
        effects = p.absent({1}, now + p.admit_s)  # rank 1 (gen-0) is there, rank 2 (gen-1) is not
        (sever,) = [e for e in effects if isinstance(e, Sever)]
        benched += [e.fields["benched_s"] for e in effects if isinstance(e, Log) and e.event == "member_absent"]
        assert sever.member == "gen-1" and not p.admission_due(now + 2 * p.admit_s), "looked at once a round"
        p.collective_finished(now + p.admit_s, CollectiveResult(join_s=p.admit_s, bcast_s=0.0, failed="cancelled"))
        p.heartbeat("gen-0", 0, now + p.admit_s)
        p.heartbeat("gen-1", 0, now + p.admit_s)
        p.tick(now + p.admit_s + 0.1)
        assert "gen-1" not in p._members(now + p.admit_s + 0.2)
    fresh = CONFIG.link.peer_timeout_s / 2
    assert benched == [fresh, 2 * fresh]
    assert p.absent({1, 2}, now) == [], "no round running: nothing to look at"
