"""The weight broadcaster end to end: a real broadcaster process (``april broadcaster``), real
generator-side processes (a ``WeightSubscriber`` over a recording engine, started from the testing
kit: ``python -m april_async.testing.weights member ...``), real gloo groups over loopback; the
test process plays the learner (a ``Peer`` on the broadcaster's hub) and the broker (a ``Hub``).

Also: ``WeightGroup`` on its own, with real gloo groups between threads of this process.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import msgspec
import pytest
import torch

from april_async.testing.weights import LINK, TIMEOUT_S, RawGenerator, RecordingEngine, ScriptedSession, state_fingerprint, policy
from april_async.weights.flat import flatten
from april_async.weights.group import GroupError, WeightGroup
from april_async.wire import messages as m


def test_fan_out_late_joiner_and_a_killed_member(weights):
    w = weights
    w.start_broadcaster()
    w.start_member("gen-0")
    w.start_member("gen-1")
    w.connect_learner()
    w.wait("both generators' sessions", lambda: set(w.status().get("members", {})) == {"gen-0", "gen-1"})

    # versions 1 and 2 reach both generators, byte for byte, and the broker hears of each
    v1 = w.send_version(1)
    w.wait("version 1 everywhere", lambda: w.holds("gen-0", 1, v1) and w.holds("gen-1", 1, v1))
    v2 = w.send_version(2)
    w.wait("version 2 everywhere", lambda: w.holds("gen-0", 2, v2) and w.holds("gen-1", 2, v2))
    w.wait("published 1 and 2", lambda: {1, 2} <= set(w.broker.published))
    assert [x["version"] for x in w.loads("gen-0")] == [1, 2]

    # an older or equal version is ignored
    w.send_version(2)
    w.send_version(1)
    w.broker.pump(0.5)
    assert [x["version"] for x in w.loads("gen-1")] == [1, 2]

    # a late joiner gets the held version without a new update
    w.start_member("gen-2")
    w.wait("version 2 on the late joiner", lambda: w.holds("gen-2", 2, v2))
    assert [x["version"] for x in w.loads("gen-2")] == [2]
    assert [x["version"] for x in w.loads("gen-0")] == [1, 2], "a member at version 2 must not reload it"

    # a SIGKILLed member does not keep the next version from the others
    w.cluster.kill("gen-1")
    v3 = w.send_version(3)
    w.wait("version 3 on the survivors", lambda: w.holds("gen-0", 3, v3) and w.holds("gen-2", 3, v3))
    w.wait("published 3", lambda: 3 in w.broker.published)
    # the status file is rewritten just after the publish goes out: wait for it, not assume it
    w.wait("gen-1 forgotten and the survivors at 3 in the status",
           lambda: w.status().get("members") == {"gen-0": 3, "gen-2": 3})
    assert sorted(set(w.broker.published)) == [1, 2, 3]


def test_versions_are_published_at_once_without_generators(weights):
    w = weights
    w.start_broadcaster()
    w.connect_learner()
    w.wait("the learner's session", lambda: w.status() != {})
    w.send_version(5)
    w.wait("published 5", lambda: 5 in w.broker.published, timeout_s=10)
    # a generator that comes later still gets it before anything else
    w.start_member("gen-0")
    v5 = state_fingerprint(policy(5))
    w.wait("version 5 on gen-0", lambda: w.holds("gen-0", 5, v5))


def test_a_stopped_member_is_dropped_and_catches_up_when_it_resumes(weights):
    """SIGSTOP: alive but silent, its socket buffers fill; the others still get the version."""
    w = weights
    w.start_broadcaster()
    w.start_member("gen-0")
    w.start_member("gen-1")
    w.connect_learner()
    w.wait("both sessions", lambda: set(w.status().get("members", {})) == {"gen-0", "gen-1"})
    v1 = w.send_version(1)
    w.wait("version 1 everywhere", lambda: w.holds("gen-0", 1, v1) and w.holds("gen-1", 1, v1))
    w.cluster.procs["gen-1"].send_signal(signal.SIGSTOP)
    try:
        v2 = w.send_version(2)
        w.wait("version 2 on gen-0", lambda: w.holds("gen-0", 2, v2), timeout_s=4 * TIMEOUT_S)
        assert not w.holds("gen-1", 2, v2)
    finally:
        w.cluster.procs["gen-1"].send_signal(signal.SIGCONT)
    w.wait("version 2 on the resumed gen-1", lambda: w.holds("gen-1", 2, v2), timeout_s=4 * TIMEOUT_S)
    assert [x["version"] for x in w.loads("gen-0")] == [1, 2]


def test_a_restarted_broadcaster_serves_the_same_generators(weights):
    w = weights
    w.start_broadcaster()
    w.start_member("gen-0")
    w.connect_learner()
    w.wait("gen-0's session", lambda: "gen-0" in w.status().get("members", {}))
    v1 = w.send_version(1)
    w.wait("version 1", lambda: w.holds("gen-0", 1, v1))
    w.cluster.kill("broadcaster")
    w.status_file.unlink()
    w.start_broadcaster()  # same endpoint, a new store port: generators learn it from the announce
    w.wait("gen-0 back with version 1", lambda: w.status().get("members", {}).get("gen-0") == 1)
    # The learner's session is new too (a real learner hands its version over again then); an
    # update sent before its hello reaches the new broadcaster would be refused as sessionless.
    w.wait("the learner's new session", lambda: w.learner_sessions >= 2)
    v2 = w.send_version(2)
    w.wait("version 2 after the restart", lambda: w.holds("gen-0", 2, v2))
    w.wait("published 2", lambda: 2 in w.broker.published)


def test_a_member_that_reconnects_mid_round_gets_its_announce_again(weights):
    """A generator whose connection dropped while a round began (its announce went down the old
    one) says hello on a new connection: the broadcaster sends the announce again, so the round
    completes at once instead of waiting its whole timeout. The test plays that generator with
    raw sockets: the first never acts on its announce; the second joins and acks."""
    w = weights
    w.start_broadcaster()
    gen = RawGenerator(w)
    w.connect_learner()
    gen.hold_session()
    w.send_version(1)
    first = gen.announce(10.0)
    assert first is not None and first.version == 1, w.cluster.dump_logs()
    gen.sock.close()  # as if it never arrived: the connection dropped
    gen.connect()
    try:
        gen.hello()
        again = gen.announce(TIMEOUT_S / 2)
        assert again is not None, f"no announce on the new connection\n{w.cluster.dump_logs()}"
        assert (again.version, again.group.epoch, again.group.rank) == (1, first.group.epoch, 1)
        t0 = time.monotonic()
        group = WeightGroup()
        group.join(again.group)
        buf = torch.empty(again.num_bytes, dtype=torch.uint8)
        group.broadcast(buf, again.bucket_bytes, tag=1)
        gen.send(m.Heartbeat(policy_version=1))
        w.wait("published 1", lambda: 1 in w.broker.published)
        assert time.monotonic() - t0 < TIMEOUT_S, "the round waited for its timeout"
        assert "announce_resent" in w.cluster.logs["broadcaster"].read_text()
        group.close()
    finally:
        gen.close()


def test_a_member_given_the_same_announce_twice_receives_once_and_is_not_blocked(tmp_path):
    """The other side of the resend above: when the first announce did arrive, the copy must be
    ignored, not waited on (rank 0 broadcasts each epoch and version once)."""
    from april_async.weights.subscriber import WeightSubscriber

    engine = RecordingEngine(tmp_path / "loads.jsonl")
    sub = WeightSubscriber("gen-0", "tcp://127.0.0.1:1", LINK, engine, peer_factory=ScriptedSession)
    root = WeightGroup.host("127.0.0.1", 0, timeout_s=TIMEOUT_S)

    def announce(version):
        specs, buf = flatten(policy(version))
        return buf, m.WeightsAnnounce(version=version, tensors=specs, num_bytes=buf.numel(), bucket_bytes=1 << 16,
                                      group=m.GroupSpec(epoch=1, rank=1, world_size=2, store=root.store_address,
                                                        backend="gloo", timeout_s=TIMEOUT_S))

    def serve(buf, version, join):
        if join:
            root.join(m.GroupSpec(epoch=1, rank=0, world_size=2, store=root.store_address, backend="gloo",
                                  timeout_s=TIMEOUT_S))
        root.broadcast(buf, 1 << 16, tag=version)

    try:
        for version in (1, 2):
            buf, ann = announce(version)
            sub.peer.inbox += [ann, ann] if version == 1 else [ann]  # version 1 arrives twice
            t = threading.Thread(target=serve, args=(buf, version, version == 1))
            t.start()
            deadline = time.monotonic() + TIMEOUT_S / 2  # well inside a collective timeout
            while engine.policy_version < version and time.monotonic() < deadline:
                sub.poll(0.02)
            t.join()
            assert engine.policy_version == version, f"version {version} not loaded within {TIMEOUT_S / 2} s"
        loads = [json.loads(line)["version"] for line in (tmp_path / "loads.jsonl").read_text().splitlines()]
        assert loads == [1, 2] and sub.failures == 0
    finally:
        sub.close()
        root.close()


def test_a_member_answers_a_resent_announce_once_its_receive_ends(tmp_path):
    """A member's receive of a round ends just after it said hello again (the broadcaster was frozen
    for 3 s, and thawed); the broadcaster sent the round's announce again on the new session. The
    receipt belongs to the old session and goes unanswered there, and the copy was skipped as
    already tried: nothing answered the round, which waited its whole timeout (a fresh clone's
    ``test_hangs``, issue 42). The copy is answered now, with the version the receive brought."""
    from april_async.weights.subscriber import WeightSubscriber

    engine = RecordingEngine(tmp_path / "loads.jsonl")
    sub = WeightSubscriber("gen-0", "tcp://127.0.0.1:1", LINK, engine, peer_factory=ScriptedSession)
    root = WeightGroup.host("127.0.0.1", 0, timeout_s=TIMEOUT_S)
    specs, buf = flatten(policy(1))
    spec = m.GroupSpec(epoch=1, rank=0, world_size=2, store=root.store_address, backend="gloo",
                       timeout_s=TIMEOUT_S)
    ann = m.WeightsAnnounce(version=1, tensors=specs, num_bytes=buf.numel(), bucket_bytes=1 << 16,
                            group=msgspec.structs.replace(spec, rank=1))
    try:
        sub.peer.inbox.append(ann)
        sub.poll(0.0)  # the worker joins epoch 1 and waits for rank 0
        root.join(spec)
        sub._on_connect(sub.peer)  # a new session (the broadcaster looked dead) ...
        sub.peer.inbox.append(ann)  # ... on which the round's announce comes again
        sub.poll(0.0)
        answered_from = len(sub.peer.sent)
        root.broadcast(buf, 1 << 16, tag=1)
        deadline = time.monotonic() + TIMEOUT_S / 2
        answers = []
        while not answers and time.monotonic() < deadline:
            sub.poll(0.05)
            answers = [b for b in sub.peer.sent[answered_from:] if isinstance(b, m.Heartbeat)]
        assert engine.policy_version == 1
        assert [a.policy_version for a in answers] == [1], f"no answer in the new session: {sub.peer.sent}"
    finally:
        sub.close()
        root.close()


def test_a_member_gives_up_a_join_at_a_broadcaster_that_restarted(tmp_path):
    """A member joining an epoch when its broadcaster died waits at the dead one's rendezvous; its
    worker takes announces one at a time, so every announce of the new broadcaster waited behind it
    for the whole ``timeout_s`` (the three-host soak, issue 42: a minute without weights). The new
    broadcaster's welcome gives the join up at once, and the next announce is served."""
    from april_async.weights.subscriber import WeightSubscriber

    timeout_s = 30.0
    engine = RecordingEngine(tmp_path / "loads.jsonl")
    sub = WeightSubscriber("gen-0", "tcp://127.0.0.1:1", LINK, engine, peer_factory=ScriptedSession)
    old = WeightGroup.host("127.0.0.1", 0, timeout_s, rendezvous_port=0, allow_open=True)
    new = WeightGroup.host("127.0.0.1", 0, timeout_s, rendezvous_port=0, allow_open=True)

    def announce(root, version):
        specs, buf = flatten(policy(version))
        group = m.GroupSpec(epoch=1, rank=1, world_size=2, store=root.store_address, backend="gloo",
                            timeout_s=timeout_s, key_prefix="k", rendezvous=root.rendezvous)
        return buf, m.WeightsAnnounce(version=version, tensors=specs, num_bytes=buf.numel(),
                                      bucket_bytes=1 << 16, group=group)

    try:
        sub.peer.inbox += [m.Welcome(broker_epoch="old", policy_version=0, heartbeat_interval_s=0.1,
                                     peer_timeout_s=0.8, max_message_bytes=1 << 20), announce(old, 1)[1]]
        sub.poll(0.0)  # the worker joins epoch 1 of the old broadcaster, whose rank 0 never comes
        time.sleep(0.5)
        assert sub.failures == 0
        buf, ann = announce(new, 2)
        sub.peer.inbox += [m.Welcome(broker_epoch="new", policy_version=0, heartbeat_interval_s=0.1,
                                     peer_timeout_s=0.8, max_message_bytes=1 << 20), ann]
        t0 = time.monotonic()
        serve = threading.Thread(target=lambda: (new.join(m.GroupSpec(
            epoch=1, rank=0, world_size=2, store=new.store_address, backend="gloo", timeout_s=timeout_s,
            key_prefix="k", rendezvous=new.rendezvous)), new.broadcast(buf, 1 << 16, tag=2)))
        serve.start()
        while engine.policy_version < 2 and time.monotonic() - t0 < timeout_s:
            sub.poll(0.05)
        took = time.monotonic() - t0
        serve.join(timeout_s)
        assert engine.policy_version == 2, f"version 2 not loaded within {timeout_s} s"
        assert took < timeout_s / 3 and sub.failures == 1, (took, sub.failures)
    finally:
        sub.close()
        old.close()
        new.close()


def test_a_received_version_wakes_a_caller_waiting_on_the_subscriber(tmp_path):
    """An idle generator waits on ``waitables``: the worker's receipt must wake it (not its wait's
    timeout), ``poll`` then loads it, and nothing is left to wake it again."""
    from april_async.transport.peer import wait_any
    from april_async.weights.subscriber import WeightSubscriber

    engine = RecordingEngine(tmp_path / "loads.jsonl")
    sub = WeightSubscriber("gen-0", "tcp://127.0.0.1:1", LINK, engine, peer_factory=ScriptedSession)
    root = WeightGroup.host("127.0.0.1", 0, timeout_s=TIMEOUT_S)
    spec = m.GroupSpec(epoch=1, rank=0, world_size=2, store=root.store_address, backend="gloo", timeout_s=TIMEOUT_S)
    specs, buf = flatten(policy(1))
    ann = m.WeightsAnnounce(version=1, tensors=specs, num_bytes=buf.numel(), bucket_bytes=1 << 16,
                            group=msgspec.structs.replace(spec, rank=1))

    def serve():
        root.join(spec)
        root.broadcast(buf, 1 << 16, tag=1)

    try:
        assert not wait_any(sub.waitables(), 0.05)  # nothing yet
        sub.peer.inbox.append(ann)
        assert not sub.poll(0.0)  # the announce goes to the worker; nothing received yet
        t = threading.Thread(target=serve)
        t.start()
        t0 = time.monotonic()
        assert wait_any(sub.waitables(), TIMEOUT_S), "the receipt did not wake the caller"
        woke_s = time.monotonic() - t0
        t.join()
        assert woke_s < TIMEOUT_S / 2 and sub.poll(0.0) and engine.policy_version == 1
        assert not wait_any(sub.waitables(), 0.05), "a wake-up was left behind after the version loaded"
    finally:
        sub.close()
        root.close()


# ---------------------------------------------------------------------------------------------
# WeightGroup alone: real gloo groups between threads of this process


def _round(root: WeightGroup, members: list[WeightGroup], epoch: int, data: torch.Tensor, bucket: int, *,
           sizes: list[int] | None = None, timeout_s: float = 3.0):
    """One broadcast from ``root`` to ``members``; returns (root error, {member: bytes or error})."""
    world = len(members) + 1

    def spec(rank):
        return m.GroupSpec(epoch=epoch, rank=rank, world_size=world, store=root.store_address, backend="gloo",
                           timeout_s=timeout_s)

    got: dict[int, torch.Tensor | Exception] = {}

    def member(i):
        try:
            if members[i].epoch != epoch:
                members[i].join(spec(i + 1))
            buf = torch.empty(sizes[i] if sizes else data.numel(), dtype=torch.uint8)
            members[i].broadcast(buf, bucket, tag=epoch)
            got[i] = buf
        except Exception as e:  # noqa: BLE001 -- returned to the caller, which checks its type
            got[i] = e

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    root_error = None
    try:
        if root.epoch != epoch:
            root.join(spec(0))
        root.broadcast(data, bucket, tag=epoch)
    except GroupError as e:
        root_error = e
    for t in threads:
        t.join()
    return root_error, got


def test_group_reforms_across_epochs_and_world_sizes():
    root = WeightGroup.host("127.0.0.1", 0, 3.0)
    members = [WeightGroup(), WeightGroup()]
    try:
        data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
        for epoch, n in [(1, 2), (1, 2), (2, 1), (3, 2)]:  # the same group twice, then shrink, then grow
            err, got = _round(root, members[:n], epoch, data, 3000)
            assert err is None and all(torch.equal(got[i], data) for i in range(n)), (epoch, err, got)
    finally:
        for g in (*members, root):
            g.close()


def test_a_member_out_of_step_raises_instead_of_aborting_the_process():
    root = WeightGroup.host("127.0.0.1", 0, 2.0)
    members = [WeightGroup(), WeightGroup()]
    try:
        data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
        err, got = _round(root, members, 1, data, 300, sizes=[1000, 1001], timeout_s=2.0)
        assert isinstance(got[1], GroupError) and "expected [1, 1, 1001, 300]" in str(got[1])
        assert isinstance(err, GroupError) and members[1].epoch is None and root.epoch is None  # both left
        err, got = _round(root, members, 2, data, 300)  # a new epoch works again
        assert err is None and torch.equal(got[0], data) and torch.equal(got[1], data)
    finally:
        for g in (*members, root):
            g.close()


def test_a_member_that_never_comes_fails_the_join_in_bounded_time():
    root = WeightGroup.host("127.0.0.1", 0, 1.0)
    try:
        spec = m.GroupSpec(epoch=1, rank=0, world_size=2, store=root.store_address, backend="gloo", timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(GroupError, match="joining epoch 1 as rank 0 of 2 failed"):
            root.join(spec)
        assert time.monotonic() - t0 < 10
    finally:
        root.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two CUDA devices")
def test_nccl_broadcast_between_two_gpus():
    root = WeightGroup.host("127.0.0.1", 0, 30.0, device="cuda:0")
    member = WeightGroup(device="cuda:1")
    try:
        data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0")
        got = {}

        def recv():
            spec = m.GroupSpec(epoch=1, rank=1, world_size=2, store=root.store_address, backend="nccl", timeout_s=30)
            member.join(spec)
            buf = torch.empty(data.numel(), dtype=torch.uint8, device=member.buffer_device())
            member.broadcast(buf, 1 << 18, tag=1)
            got["buf"] = buf

        t = threading.Thread(target=recv)
        t.start()
        root.join(m.GroupSpec(epoch=1, rank=0, world_size=2, store=root.store_address, backend="nccl", timeout_s=30))
        root.broadcast(data, 1 << 18, tag=1)
        t.join(60)
        assert torch.equal(got["buf"].cpu(), data.cpu())
    finally:
        member.close()
        root.close()

