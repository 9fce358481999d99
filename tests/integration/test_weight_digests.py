"""Protocol 1.6 end to end: a member refuses bytes that do not match the announced digests, and
the broadcaster's announces carry the run's key prefix and one digest per bucket. Since 1.7 under
the announce's ``digest_alg``: BLAKE3-128 to a group whose members all speak 1.7, BLAKE2b-128 as
soon as one speaks 1.6; a member refuses an algorithm it does not know.

The member's side runs a ``WeightSubscriber`` over a recording engine in this process, against a
real gloo group whose rank 0 is a thread of this process (it can send whatever bytes a test
wants). The broadcaster's side is a real ``april broadcaster`` process (the ``weights`` fixture),
with the test playing the generator on raw sockets.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from contextlib import contextmanager

import msgspec
import pytest
import torch
from structlog.testing import capture_logs

from april_async.testing.weights import (LINK, TIMEOUT_S, RawGenerator, RecordingEngine, ScriptedSession, announces,
                                         hold_sessions, policy)
from april_async.weights.flat import bucket_digests, buckets, check_digests, flatten
from april_async.weights.group import WeightGroup
from april_async.wire import messages as m

BUCKET = 1 << 16
B2, B3 = m.BLAKE2B_128, m.BLAKE3_128


def _loads(tmp_path) -> list[int]:
    """The versions the recording engine loaded, in order."""
    return [json.loads(line)["version"] for line in (tmp_path / "loads.jsonl").read_text().splitlines()]


@contextmanager
def _member(tmp_path):
    """A ``WeightSubscriber`` over a recording engine, in a gloo group whose rank 0 is a thread of
    this process; yields ``(sub, engine, round_)``, where ``round_(version, sent, digests, alg,
    join=False)`` announces ``version`` with ``digests`` under ``alg``, sends the bytes ``sent``
    and returns the member's answer (a heartbeat)."""
    from april_async.weights.subscriber import WeightSubscriber

    engine = RecordingEngine(tmp_path / "loads.jsonl")
    root = WeightGroup.host("127.0.0.1", 0, timeout_s=TIMEOUT_S)
    prefix = "0123456789abcdef" * 2

    def spec(rank):
        return m.GroupSpec(epoch=1, rank=rank, world_size=2, store=root.store_address, backend="gloo",
                           timeout_s=TIMEOUT_S, key_prefix=prefix)

    def serve(buf, version, join):
        if join:
            root.join(spec(0))
        root.broadcast(buf, BUCKET, tag=version)

    def round_(version, sent, announced_digests, alg=B2, join=False):
        specs, _ = flatten(policy(version))
        sub.peer.inbox.append(m.WeightsAnnounce(version=version, tensors=specs, num_bytes=sent.numel(),
                                                bucket_bytes=BUCKET, group=spec(1), digests=announced_digests,
                                                digest_alg=alg))
        answered = len([b for b in sub.peer.sent if isinstance(b, m.Heartbeat)])
        t = threading.Thread(target=serve, args=(sent, version, join))
        t.start()
        deadline = time.monotonic() + TIMEOUT_S
        while len([b for b in sub.peer.sent if isinstance(b, m.Heartbeat)]) == answered:
            assert time.monotonic() < deadline, f"no answer to version {version} within {TIMEOUT_S} s"
            sub.poll(0.02)
        t.join()
        return sub.peer.sent[-1]

    sub = WeightSubscriber("gen-0", "tcp://127.0.0.1:1", LINK, engine, peer_factory=ScriptedSession)
    try:
        yield sub, engine, round_
    finally:
        sub.close()
        root.close()


@pytest.mark.parametrize("alg", [B2, B3])
def test_a_member_refuses_bytes_that_do_not_match_their_digests_and_keeps_its_weights(tmp_path, alg):
    with _member(tmp_path) as (sub, engine, round_), capture_logs() as logs:
        # (the subscriber's logger resolves its processors at first use: inside capture_logs)
        _, v1 = flatten(policy(1))
        assert round_(1, v1, bucket_digests(v1, BUCKET, alg), alg, join=True).policy_version == 1

        # version 2 announced with its digests, but one byte of bucket 3 differs on the wire
        _, v2 = flatten(policy(2))
        digests = bucket_digests(v2, BUCKET, alg)
        assert len(digests) > 4
        tampered = v2.clone()
        tampered[3 * BUCKET + 17] ^= 0x40
        ack = round_(2, tampered, digests, alg)
        assert ack.policy_version == 1, "a refused version must not be reported as held"
        assert engine.policy_version == 1 and sub.refused == 1 and sub.failures == 1
        assert _loads(tmp_path) == [1], "the engine must keep its old weights"
        (refused,) = [e for e in logs if e["event"] == "weights_refused"]
        assert refused["version"] == 2 and refused["bucket"] == 3 and refused["digest_alg"] == alg
        assert refused["expected"] == digests[3]
        assert refused["got"] == bucket_digests(tampered, BUCKET, alg)[3]

        # the same group still works: version 3 with no digests (a 1.5 broadcaster) loads, unverified
        _, v3 = flatten(policy(3))
        assert round_(3, v3, []).policy_version == 3
        assert [e["version"] for e in logs if e["event"] == "weights_unverified"] == [3]
        assert _loads(tmp_path) == [1, 3] and sub.refused == 1


def test_a_member_receives_then_refuses_an_algorithm_it_does_not_know(tmp_path):
    """It takes part in the broadcast (every rank must, or the others stall), refuses the bytes
    without loading them, names the algorithm, and the group goes on serving it."""
    with _member(tmp_path) as (sub, engine, round_), capture_logs() as logs:
        _, v1 = flatten(policy(1))
        assert round_(1, v1, bucket_digests(v1, BUCKET, B3), B3, join=True).policy_version == 1
        _, v2 = flatten(policy(2))
        ack = round_(2, v2, bucket_digests(v2, BUCKET, B3), "sha3-128")  # the right digests, an unknown name
        assert ack.policy_version == 1 and engine.policy_version == 1 and sub.refused == 1
        (refused,) = [e for e in logs if e["event"] == "weights_refused"]
        assert refused["digest_alg"] == "sha3-128" and "'sha3-128'" in refused["error"]
        assert refused["bucket"] is None
        _, v3 = flatten(policy(3))
        assert round_(3, v3, bucket_digests(v3, BUCKET, B3), B3).policy_version == 3
        assert _loads(tmp_path) == [1, 3]


def test_the_broadcaster_announces_its_key_prefix_and_the_digest_of_every_bucket(weights):
    """A real broadcaster: every announce carries the same 128-bit hex key prefix and one digest
    per bucket, BLAKE3-128 to this generator of protocol 1.7, and the bytes received over the
    group match them."""
    w = weights
    w.start_broadcaster()
    gen = RawGenerator(w)
    group = WeightGroup()
    try:
        w.connect_learner()
        gen.hold_session()
        prefixes = set()
        for version in (1, 2):
            w.send_version(version)
            ann = gen.announce(15.0)
            assert ann is not None, f"no announce of version {version}\n{w.cluster.dump_logs()}"
            _, expected = flatten(policy(version))
            assert ann.version == version and ann.num_bytes == expected.numel()
            assert re.fullmatch(r"[0-9a-f]{32}", ann.group.key_prefix), ann.group.key_prefix
            assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", ann.group.rendezvous), ann.group.rendezvous
            prefixes.add(ann.group.key_prefix)
            assert len(ann.digests) == len(list(buckets(ann.num_bytes, ann.bucket_bytes))) > 1
            assert ann.digest_alg == B3 and ann.digests == bucket_digests(expected, ann.bucket_bytes, B3)
            if group.epoch != ann.group.epoch:
                group.join(ann.group)
            buf = torch.empty(ann.num_bytes, dtype=torch.uint8)
            group.broadcast(buf, ann.bucket_bytes, tag=version)
            check_digests(buf, ann.bucket_bytes, ann.digests, ann.digest_alg)
            gen.send(m.Heartbeat(policy_version=version))
            w.wait(f"published {version}", lambda v=version: v in w.broker.published)
        assert len(prefixes) == 1, "one secret per broadcaster process"
        prefix = prefixes.pop()
        assert prefix not in w.cluster.logs["broadcaster"].read_text(), "the secret must not be logged"
    finally:
        group.close()
        gen.close()


class OldGenerator(RawGenerator):
    """A generator whose envelopes state protocol 1.6: it knows no ``digest_alg``."""

    def send(self, body: m.Body) -> None:
        from april_async.wire.codec import encode

        self.seq += 1
        frames = encode(body, sender=self.name, seq=self.seq)
        env = msgspec.msgpack.decode(frames[0])
        env["proto_version"] = "1.6"
        self.sock.send_multipart([msgspec.msgpack.encode(env), *frames[1:]])


def _receive(gens: dict, anns: dict[str, m.WeightsAnnounce], groups: dict[str, WeightGroup]) -> dict:
    """Every generator of ``gens`` joins its announced group (when new) and receives, each on a
    thread (they are ranks of one collective); the bytes each got."""
    got, errors = {}, []

    def run(name):
        try:
            ann = anns[name]
            if groups[name].epoch != ann.group.epoch:
                groups[name].join(ann.group)
            got[name] = torch.empty(ann.num_bytes, dtype=torch.uint8)
            groups[name].broadcast(got[name], ann.bucket_bytes, tag=ann.version)
        except Exception as e:  # noqa: BLE001 -- reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT_S)
    assert not errors, errors
    return got


def test_a_generator_of_1_6_makes_the_round_blake2b_and_blake3_returns_once_it_leaves(weights):
    """A real broadcaster with a 1.7 and a 1.6 generator: the round's announces all name (by
    leaving it out) BLAKE2b-128, which both check; once the 1.6 one has left, the next version is
    announced with BLAKE3-128."""
    w = weights
    w.start_broadcaster()
    gens = {"gen-new": RawGenerator(w, "gen-new"), "gen-old": OldGenerator(w, "gen-old")}
    groups = {name: WeightGroup() for name in gens}
    try:
        w.connect_learner()
        hold_sessions(list(gens.values()))
        w.send_version(1)
        anns = announces(list(gens.values()), 15.0)
        assert all(anns.values()), f"announces {anns}\n{w.cluster.dump_logs()}"
        _, v1 = flatten(policy(1))
        assert {a.digest_alg for a in anns.values()} == {B2}
        assert all(a.digests == bucket_digests(v1, a.bucket_bytes) for a in anns.values())
        for name, buf in _receive(gens, anns, groups).items():
            check_digests(buf, anns[name].bucket_bytes, anns[name].digests, anns[name].digest_alg)
            gens[name].send(m.Heartbeat(policy_version=1))
        w.wait("published 1", lambda: 1 in w.broker.published)

        gens.pop("gen-old").close()  # bye
        w.wait("gen-old gone", lambda: "gen-old" not in w.status().get("members", {}))
        w.send_version(2)
        ann = gens["gen-new"].announce(15.0)
        assert ann is not None and ann.version == 2, f"{ann}\n{w.cluster.dump_logs()}"
        _, v2 = flatten(policy(2))
        assert ann.digest_alg == B3 and ann.digests == bucket_digests(v2, ann.bucket_bytes, B3)
        buf = _receive(gens, {"gen-new": ann}, groups)["gen-new"]
        check_digests(buf, ann.bucket_bytes, ann.digests, B3)
        gens["gen-new"].send(m.Heartbeat(policy_version=2))
        w.wait("published 2", lambda: 2 in w.broker.published)
    finally:
        for group in groups.values():
            group.close()
        for gen in gens.values():
            gen.close()


def test_the_broadcaster_refuses_a_generator_of_protocol_1_5(weights):
    """A 1.5 generator would wait for its group under keys rank 0 never writes: refused at hello."""
    import zmq

    from april_async.wire.codec import decode, encode

    w = weights
    w.start_broadcaster()
    w.wait_serving()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"gen-old")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(w.endpoint)
    try:
        frames = encode(m.Hello(role="generator", instance="gen-old", policy_version=0), sender="gen-old", seq=1)
        env = msgspec.msgpack.decode(frames[0])
        env["proto_version"] = "1.5"
        sock.send_multipart([msgspec.msgpack.encode(env), *frames[1:]])
        assert sock.poll(10_000), f"no answer\n{w.cluster.dump_logs()}"
        reply = decode(sock.recv_multipart()).body
        assert isinstance(reply, m.Error) and reply.code == "refused"
        assert "1.5" in reply.message and "key_prefix" in reply.message
        time.sleep(0.3)
        assert "gen-old" not in w.status().get("members", {})
    finally:
        sock.close()


def test_a_stranger_on_the_store_port_cannot_learn_the_groups_keys(tmp_path):
    """Issue 17: the group meets on the rendezvous store (reached over CurveZMQ with the run's keys,
    listing nothing), so the TCPStore, which lists its keys to any client, holds none of the
    group's; and a stranger without the run's keys is refused by the rendezvous store."""
    import datetime

    import torch.distributed as dist

    from april_async.transport.curve import make_keys
    from april_async.weights.zstore import StoreError, ZmqStore

    keys = tmp_path / "keys"
    make_keys(keys)
    root = WeightGroup.host("127.0.0.1", 0, timeout_s=TIMEOUT_S, rendezvous_port=0, keys=keys)
    member = WeightGroup(keys=keys)
    prefix = secrets.token_hex(16)

    def spec(rank):
        return m.GroupSpec(epoch=1, rank=rank, world_size=2, store=root.store_address, backend="gloo",
                           timeout_s=TIMEOUT_S, key_prefix=prefix, rendezvous=root.rendezvous)

    t = threading.Thread(target=member.join, args=(spec(1),))
    t.start()
    try:
        root.join(spec(0))
        t.join()
        assert member.epoch == 1, "the member did not join over the rendezvous store"
        got = torch.empty(3, dtype=torch.uint8)
        t = threading.Thread(target=member.broadcast, args=(got, 2), kwargs={"tag": 9})
        t.start()
        root.broadcast(torch.tensor([7, 8, 9], dtype=torch.uint8), 2, tag=9)
        t.join()
        assert got.tolist() == [7, 8, 9]

        host, port = root.store_address.rsplit(":", 1)
        stranger = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        listed = stranger.list_keys()
        assert not any(prefix in k or "epoch-1" in k for k in listed), f"a stranger lists {listed}"

        keyless = ZmqStore(root.rendezvous, timeout_s=TIMEOUT_S)
        try:
            with pytest.raises(StoreError, match="refused this process"):
                keyless.check([f"{prefix}/epoch-1/0/0"])
        finally:
            keyless.close()
        admitted = ZmqStore(root.rendezvous, keys=keys, timeout_s=TIMEOUT_S)
        try:
            assert admitted.num_keys() >= 2, "the group's keys are in the rendezvous store"
            with pytest.raises(StoreError, match="lists no keys"):
                admitted.list_keys()
            root.leave()
            assert admitted.num_keys() == 0, "rank 0 deletes an epoch's keys when it leaves it"
        finally:
            admitted.close()
    finally:
        member.close()
        root.close()
