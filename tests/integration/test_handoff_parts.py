"""Weights handed over in parts (protocol 1.4), end to end: a real broadcaster process, a real
member process (``april_async.testing.weights``'s), the learner's own ``WeightHandoff`` for
good hand-offs and a raw DEALER socket for broken ones (a ``Peer`` keeps ``refused`` errors to
itself). Also ``send_parts`` against bare ZeroMQ sockets: it asks for the next part only once the
previous one's bytes are released, and says so to the producer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import torch
import zmq

from april_async.config import LinkConfig
from april_async.testing.cluster import FAST_LINK
from april_async.testing.fake_broker import NoBroker
from april_async.testing.procs import free_port
from april_async.testing.weights import LINK, TIMEOUT_S, Weights, state_fingerprint, policy
from april_async.transport.peer import Peer
from april_async.weights.flat import flatten, layout, tensor_buckets
from april_async.weights.handoff import WeightHandoff
from april_async.wire import messages as m
from april_async.wire.codec import decode, encode

MAX_UPDATE_BYTES = 4 << 20  # the broadcaster's limit here: a policy() is ~1 MB


def start_broadcaster(w: Weights) -> None:
    w.cluster.start("broadcaster", "broadcaster", {
        "name": "broadcaster", "bind": w.endpoint, "link.broker": w.broker.hub.endpoint, **FAST_LINK,
        "store_port": free_port(), "backend": "gloo", "bucket_mb": 0.25, "timeout_s": TIMEOUT_S,
        "status_file": str(w.status_file), "max_update_bytes": MAX_UPDATE_BYTES})


def state_parts(state, bucket_bytes: int):
    """``(specs, total_bytes, parts, num_parts)`` of ``state`` cut by ``tensor_buckets``: the producer
    fills one reused array per range, as a gathering learner would, and takes a fresh one when
    told the last was not released."""
    specs, total = layout((name, t.dtype, t.shape) for name, t in state.items())
    ranges = tensor_buckets(specs, bucket_bytes)
    tensors = list(state.values())

    def parts() -> Iterator[tuple[int, np.ndarray]]:
        buf = None
        for start, stop, indices in ranges:
            if buf is None or buf.nbytes < stop - start:
                buf = np.empty(stop - start, dtype=np.uint8)
            view = buf[: stop - start]
            view.fill(0)  # the alignment padding
            for i in indices:
                raw = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                view[specs[i].offset - start: specs[i].offset - start + raw.nbytes] = raw
            if not (yield start, view):
                buf = None

    return specs, total, parts(), len(ranges)


class RawLearner:
    """A learner session on a bare DEALER: sends what it is told, and reads every reply."""

    def __init__(self, endpoint: str, name: str = "learner-raw"):
        self.name, self.seq = name, 0
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.errors: list[tuple[str | None, m.Error]] = []  # (parent_id, error)
        self.send(m.Hello(role="learner", instance=name, policy_version=0))

    def frames(self, body: m.Body, msg_id: str) -> list:
        self.seq += 1
        return encode(body, sender=self.name, seq=self.seq, msg_id=msg_id)

    def send(self, body: m.Body) -> str:
        msg_id = f"{self.seq + 1:016x}"
        self.sock.send_multipart(self.frames(body, msg_id))
        return msg_id

    def pump(self) -> None:
        self.send(m.Heartbeat())  # stay alive: the hub's peer timeout here is under a second
        while self.sock.poll(0):
            msg = decode(self.sock.recv_multipart())
            if isinstance(msg.body, m.Error):
                self.errors.append((msg.parent_id, msg.body))

    def close(self) -> None:
        self.sock.send_multipart(self.frames(m.Bye(reason="done"), "ff"))
        self.sock.close()


def update(version: int, data: bytes | np.ndarray, **fields) -> m.WeightsUpdate:
    data = np.frombuffer(bytes(data), dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    return m.WeightsUpdate(version=version, tensors=fields.pop("tensors", []), data=data, **fields)


def handoff_for(w: Weights, current) -> WeightHandoff:
    return WeightHandoff("learner-0", lambda on_connect: Peer(w.endpoint, "learner-0", link=LINK,
                                                              on_connect=on_connect), current)


def wait(w: Weights, what: str, cond, *, raw: RawLearner | None = None, handoff: WeightHandoff | None = None,
         timeout_s: float = 25.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; status {w.status()}\n{w.cluster.dump_logs()}")
        w.broker.pump(0.05)
        if raw is not None:
            raw.pump()
        if handoff is not None:
            handoff.pump()
        w.cluster.assert_alive()


# ---------------------------------------------------------------------------------------------
# Against a real broadcaster


def test_a_three_part_handoff_is_held_and_broadcast_as_the_same_bytes(weights):
    w = weights
    start_broadcaster(w)
    w.start_member("gen-0")
    held = {"version": 0}
    handoff = handoff_for(w, lambda: (held["version"], None))
    try:
        # Both sessions open (the learner's: a message from the broadcaster came): a version handed
        # over while the learner's peer waits out a reconnect back-off is dropped, and this test's
        # ``current`` does not name it for the hand-off again as the learner's own does.
        wait(w, "gen-0 and the learner", lambda: "gen-0" in w.status().get("members", {})
             and handoff.peer_proto is not None, handoff=handoff)

        handoff.send(1, policy(1))  # one part, as before 1.4
        wait(w, "version 1 on gen-0", lambda: w.holds("gen-0", 1, state_fingerprint(policy(1))), handoff=handoff)

        specs, total, parts, n = state_parts(policy(2), bucket_bytes=1 << 19)
        assert n == 3
        flat_specs, flat = flatten(policy(2))
        assert (specs, total) == (flat_specs, flat.numel())  # the layout of the one-part hand-off
        handoff.send_parts(2, specs, total, parts, n)
        held["version"] = 2
        wait(w, "version 2 on gen-0", lambda: w.holds("gen-0", 2, state_fingerprint(policy(2))), handoff=handoff)
        wait(w, "published 2", lambda: 2 in w.broker.published, handoff=handoff)
        assert handoff.unreleased == 0

        handoff.send(3, policy(3))  # and one part again
        wait(w, "version 3 on gen-0", lambda: w.holds("gen-0", 3, state_fingerprint(policy(3))), handoff=handoff)
        assert [x["version"] for x in w.loads("gen-0")] == [1, 2, 3]
        log = w.cluster.logs["broadcaster"].read_text()
        assert "update_part_refused" not in log and "assembly_abandoned" not in log
    finally:
        handoff.close()


def test_a_bad_sequence_is_refused_by_field_and_a_later_version_is_taken(weights):
    w = weights
    start_broadcaster(w)
    raw = RawLearner(w.endpoint)
    try:
        wait(w, "the learner's session", lambda: w.status() != {}, raw=raw)
        specs, total, parts, _ = state_parts(policy(9), bucket_bytes=1 << 19)
        ranges = [(offset, bytes(arr)) for offset, arr in parts]  # plain iterator: fresh copies
        a, b = ranges[1][0], ranges[2][0]
        first, second, third = (update(0, data) for _, data in ranges)

        def part(version, k, **fields):
            base = (first, second, third)[k]
            return update(version, base.data, **{"part": k, "parts": 3, "offset": ranges[k][0],
                                                 **({"tensors": specs, "total_bytes": total} if k == 0 else {}),
                                                 **fields})

        sent: dict[str, tuple[str, str]] = {}  # msg_id -> (code, field) expected
        # a gap: part 1 starts 4 bytes late; part 2 of that version is then dropped unanswered
        raw.send(part(1, 0))
        sent[raw.send(part(1, 1, offset=a + 4))] = ("refused", "$.body.offset")
        raw.send(part(1, 2))
        # an overlap
        raw.send(part(2, 0))
        sent[raw.send(part(2, 1, offset=a - 4))] = ("refused", "$.body.offset")
        # a wrong version while one is assembled
        raw.send(part(3, 0))
        sent[raw.send(part(4, 1))] = ("refused", "$.body.version")
        # part 0 missing
        sent[raw.send(part(5, 1))] = ("refused", "$.body.part")
        # bytes past total_bytes: the last part is longer than the buffer's rest
        raw.send(part(6, 0))
        raw.send(part(6, 1))
        sent[raw.send(update(6, second.data.tobytes() + bytes(third.data), part=2, parts=3, offset=b))] = (
            "refused", "$.body.data")
        # a total over the broadcaster's limit: too_large, as no version of that size can be taken
        sent[raw.send(part(7, 0, total_bytes=MAX_UPDATE_BYTES + 1))] = ("too_large", "$.body.total_bytes")
        wait(w, "an error for each", lambda: len(raw.errors) >= len(sent), raw=raw)
        raw.pump()
        time.sleep(0.3)
        raw.pump()
        got = {parent: (e.code, e.field) for parent, e in raw.errors}
        assert got == sent, [(p, e.message) for p, e in raw.errors]
        assert all(e.message.startswith("weights_update ") for _, e in raw.errors)
        assert w.status().get("version", -1) == -1 and not w.broker.published

        # a complete version after all that is taken, and so is a one-part one after it
        for k in range(3):
            raw.send(part(8, k))
        wait(w, "published 8", lambda: 8 in w.broker.published, raw=raw)
        assert w.status()["version"] == 8
        raw.send(update(9, flatten(policy(9))[1].numpy(), tensors=specs))
        wait(w, "published 9", lambda: 9 in w.broker.published, raw=raw)
        assert len(raw.errors) == len(sent)
        log = w.cluster.logs["broadcaster"].read_text()
        assert log.count("update_part_refused") == len(sent)
    finally:
        raw.close()


def test_a_newer_part_zero_abandons_an_unfinished_version(weights):
    w = weights
    start_broadcaster(w)
    w.start_member("gen-0")
    raw = RawLearner(w.endpoint)
    try:
        wait(w, "gen-0", lambda: "gen-0" in w.status().get("members", {}), raw=raw)
        specs, total, parts, _ = state_parts(policy(2), bucket_bytes=1 << 19)
        ranges = [(offset, np.array(arr)) for offset, arr in parts]
        raw.send(update(1, ranges[0][1], tensors=specs, parts=3, total_bytes=total))  # never finished
        raw.send(update(1, ranges[1][1], part=1, parts=3, offset=ranges[1][0]))
        for k, (offset, data) in enumerate(ranges):
            raw.send(update(2, data, part=k, parts=3, offset=offset,
                            **({"tensors": specs, "total_bytes": total} if k == 0 else {})))
        wait(w, "version 2 on gen-0", lambda: w.holds("gen-0", 2, state_fingerprint(policy(2))), raw=raw)
        assert not raw.errors and [x["version"] for x in w.loads("gen-0")] == [2]
        assert "assembly_abandoned" in w.cluster.logs["broadcaster"].read_text()
    finally:
        raw.close()


def test_an_update_from_a_1_3_sender_is_taken(weights):
    """A 1.3 learner sends neither ``part`` nor any other 1.4 field: a one-part update."""
    w = weights
    start_broadcaster(w)
    raw = RawLearner(w.endpoint)
    try:
        wait(w, "the learner's session", lambda: w.status() != {}, raw=raw)
        specs, buf = flatten(policy(4))
        frames = raw.frames(m.WeightsUpdate(version=4, tensors=specs, data=buf.numpy()), "0123456789abcdef")
        envelope = msgpack.unpackb(frames[0])
        assert not {"part", "parts", "offset", "total_bytes"} & set(envelope["body"])  # defaults are left out
        envelope["proto_version"] = "1.3"
        raw.sock.send_multipart([msgpack.packb(envelope), *frames[1:]])
        wait(w, "published 4", lambda: 4 in w.broker.published, raw=raw)
        assert not raw.errors
    finally:
        raw.close()


# ---------------------------------------------------------------------------------------------
# send_parts against bare ZeroMQ sockets

PART_BYTES = 1 << 20  # well over pyzmq's copy threshold: sent without a copy, so tracked
QUICK_LINK = LinkConfig(heartbeat_interval_s=0.1, peer_timeout_s=0.3)


def counting_parts(k: int, seen: list[tuple[bool | None, bool | None]], peer_of) -> Iterator[tuple[int, np.ndarray]]:
    """``k`` parts of ``PART_BYTES``, part i filled with i; at every resume records whether ZeroMQ
    still held the part yielded before (its tracker) and what the hand-off said; reuses its array
    only when told it may."""
    buf = np.empty(PART_BYTES, dtype=np.uint8)
    for i in range(k):
        buf.fill(i)
        released = yield i * PART_BYTES, buf
        tracker = peer_of().last_tracker
        seen.append((tracker.done if tracker is not None else None, released))
        if not released:
            buf = np.empty(PART_BYTES, dtype=np.uint8)


def test_send_parts_asks_for_the_next_part_only_once_the_last_is_released():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    handoff = WeightHandoff("learner-0", lambda oc: Peer(f"tcp://127.0.0.1:{port}", "learner-0", link=QUICK_LINK,
                                                         on_connect=oc), lambda: (0, None))
    try:
        seen: list = []
        specs, total = [m.TensorSpec("w", "float32", [PART_BYTES], 0)], 4 * PART_BYTES
        handoff.send_parts(7, specs, total, counting_parts(4, seen, lambda: handoff.peer), 4)
        assert seen == [(True, True)] * 4 and handoff.unreleased == 0
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 5 and time.monotonic() < deadline:  # hello, then the 4 parts
            if router.poll(100):
                got.append(decode(router.recv_multipart()[1:]).body)
        bodies = [b for b in got if isinstance(b, m.WeightsUpdate)]
        assert [(b.part, b.parts, b.offset, b.total_bytes, len(b.tensors)) for b in bodies] == [
            (0, 4, 0, total, 1), (1, 4, PART_BYTES, 0, 0), (2, 4, 2 * PART_BYTES, 0, 0), (3, 4, 3 * PART_BYTES, 0, 0)]
        for i, b in enumerate(bodies):  # the array was refilled only after ZeroMQ let go of it
            assert (b.data == i).all(), f"part {i} was overwritten before it was sent"
    finally:
        handoff.peer.close()
        router.close()


def test_send_parts_goes_on_after_peer_timeout_and_tells_the_producer_not_to_reuse():
    """Nothing listens: ZeroMQ queues every part and never lets go of it."""
    handoff = WeightHandoff("learner-0", lambda oc: Peer(f"tcp://127.0.0.1:{free_port()}", "learner-0",
                                                         link=QUICK_LINK, on_connect=oc), lambda: (0, None))
    try:
        seen: list = []
        t0 = time.monotonic()
        handoff.send_parts(3, [], 3 * PART_BYTES, counting_parts(3, seen, lambda: handoff.peer), 3)
        assert time.monotonic() - t0 >= 3 * QUICK_LINK.peer_timeout_s * 0.9
        assert seen == [(False, False)] * 3 and handoff.unreleased == 3
    finally:
        handoff.peer.close()


def test_send_parts_refuses_a_producer_out_of_step():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    handoff = WeightHandoff("learner-0", lambda oc: Peer(f"tcp://127.0.0.1:{port}", "learner-0", link=QUICK_LINK,
                                                         on_connect=oc), lambda: (0, None))
    chunk = np.zeros(8, dtype=np.uint8)
    try:
        with pytest.raises(ValueError, match="part 1: offset 12, expected 8"):
            handoff.send_parts(1, [], 24, iter([(0, chunk), (12, chunk), (20, chunk)]), 3)
        with pytest.raises(ValueError, match="the parts ended after 2 of 3"):
            handoff.send_parts(1, [], 24, [(0, chunk), (8, chunk)], 3)
        with pytest.raises(ValueError, match="go on past num_parts=2"):
            handoff.send_parts(1, [], 16, [(0, chunk), (8, chunk), (16, chunk)], 2)
        with pytest.raises(ValueError, match=r"part 1 of 2: bytes \[8, 16\) of a 24-byte buffer"):
            handoff.send_parts(1, [], 24, [(0, chunk), (8, chunk)])
        handoff.send_parts(1, [], 16, [(0, chunk), (8, chunk)])  # len() gives the count
    finally:
        handoff.peer.close()
        router.close()


def test_a_reconnect_hands_the_current_version_over_again_in_parts():
    """A second session (a restarted broadcaster) gets the held version from the parts factory;
    with no factory (``None``), ``resend_due`` names it for the learner's loop."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    chunk = np.arange(8, dtype=np.uint8)
    factory = {"on": True}

    def current():
        return 5, ((lambda: ([], 16, [(0, chunk), (8, chunk)], 2)) if factory["on"] else None)

    handoff = WeightHandoff("learner-0", lambda oc: Peer(f"tcp://127.0.0.1:{port}", "learner-0", link=QUICK_LINK,
                                                         on_connect=oc), current)
    try:
        handoff.peer._open_session()  # as after a reconnect
        assert handoff.resend_due is None
        factory["on"] = False
        handoff.peer._open_session()
        assert handoff.resend_due == 5
        handoff.send_parts(5, [], 16, [(0, chunk), (8, chunk)])
        assert handoff.resend_due is None
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 7 and time.monotonic() < deadline:
            if router.poll(100):
                got.append(decode(router.recv_multipart()[1:]).body)
        kinds = [(type(b).__name__, getattr(b, "part", None)) for b in got]
        assert kinds == [("Hello", None), ("Hello", None), ("WeightsUpdate", 0), ("WeightsUpdate", 1),
                         ("Hello", None), ("WeightsUpdate", 0), ("WeightsUpdate", 1)], kinds
    finally:
        handoff.peer.close()
        router.close()


# ---------------------------------------------------------------------------------------------
# The broadcaster's receive buffers, in process


class _Hub:
    endpoint = "inproc://none"

    def __init__(self):
        self.sent: list[m.Body] = []

    def send(self, identity, body, parent_id=None) -> bool:
        self.sent.append(body)
        return True

    def close(self) -> None:
        pass


def test_receive_buffers_are_reused_between_versions_of_one_size():
    """gloo: two buffers in turn (the held one may be broadcast from while the next arrives); a
    version of another size gets a new one; a refused assembly frees its buffer at once."""
    from types import SimpleNamespace

    from april_async.broadcaster.actor import BroadcasterActor
    from april_async.broadcaster.config import BroadcasterConfig

    hub = _Hub()
    actor = BroadcasterActor(BroadcasterConfig(store_port=0, backend="gloo"), hub, NoBroker)
    ids = iter(range(1000))

    def handle(body):
        actor.handle(b"learner-0", SimpleNamespace(body=body, sender="learner-0", msg_id=f"m{next(ids)}",
                                                    msg_type=body.msg_type), time.monotonic())

    def version(v, size=64):
        data = np.full(size, v, dtype=np.uint8)
        specs = [m.TensorSpec("w", "float32", [size // 4], 0)]
        handle(update(v, data[: size // 2], tensors=specs, parts=2, total_bytes=size))
        handle(update(v, data[size // 2:], part=1, parts=2, offset=size // 2))
        assert actor.held.version == v and (actor.held.data.numpy() == v).all()
        return actor.held.owned

    try:
        handle(m.Hello(role="learner", instance="learner-0", policy_version=0))
        a = version(1)
        b = version(2)
        assert a is not None and b is not None and b is not a
        assert version(3) is a and version(4) is b  # in turn
        c = version(5, size=128)
        assert c is not a and c is not b
        # a refused assembly hands its buffer back: the next version of that size takes it
        handle(update(6, np.zeros(64, np.uint8), tensors=[], parts=2, total_bytes=128))
        spare = actor.parts.assembly.data
        handle(update(6, np.zeros(32, np.uint8), part=1, parts=2, offset=96))  # a gap
        assert isinstance(hub.sent[-1], m.Error) and hub.sent[-1].field == "$.body.offset"
        assert actor.parts.assembly is None and actor.parts.spare is spare
        assert version(7, size=128) is spare
        # a buffer a collective still broadcasts from is not written into: version 8 gets a new one
        assert actor.parts.spare is c
        actor._job_buffer = SimpleNamespace(owned=c)
        new = version(8, size=128)
        assert new is not c and new is not spare
        assert not [b for b in hub.sent if isinstance(b, m.Error)][1:]
    finally:
        actor.close()


def test_send_reuses_its_flat_buffer_once_zeromq_released_it():
    """A one-message hand-off copies into the last version's buffer when ZeroMQ has let go of it
    (no fresh memory to fault in), never while it may still be read; each message keeps its bytes."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    handoff = WeightHandoff("learner-0", lambda oc: Peer(endpoint, "learner-0", link=QUICK_LINK,
                                                         on_connect=oc), lambda: (0, None))
    try:
        state = {"w": torch.zeros(PART_BYTES // 4)}
        buffers = []
        for version in (1, 2, 3):
            state["w"].fill_(version)
            handoff.send(version, state)
            buf, tracker = handoff._flat
            buffers.append(buf)
            if version == 1:
                tracker.wait(5)  # released: version 2 may write into it
            elif version == 2:
                handoff._flat = (buf, _Pending())  # as if ZeroMQ still read it: version 3 must not
        assert buffers[1] is buffers[0] and buffers[2] is not buffers[1]
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            if router.poll(100):
                body = decode(router.recv_multipart()[1:]).body
                if isinstance(body, m.WeightsUpdate):
                    got.append((body.version, body.data.view(np.float32)))
        assert [v for v, _ in got] == [1, 2, 3]
        for version, data in got:
            assert (data == version).all(), f"version {version} was overwritten before it was sent"
    finally:
        handoff.peer.close()
        router.close()


class _Pending:
    """A ``zmq.MessageTracker`` whose message ZeroMQ still references."""

    done = False


class _Capture:
    """A broadcaster session stand-in for ``WeightHandoff``: keeps what is sent, as the broadcaster
    would decode it off the wire (the producer may write into an array again once it is sent)."""

    def __init__(self, on_connect):
        self.sent: list[m.Body] = []
        self.last_tracker = None
        on_connect(self)

    def send(self, body, parent_id=None, *, track=False):
        frames = encode(body, sender="learner-0", seq=len(self.sent) + 1)
        self.sent.append(decode([bytes(f) for f in frames]).body)

    def poll(self, timeout_s):
        return None

    def close(self):
        pass


def test_an_adapter_handed_over_in_parts_is_held_and_announced_to_1_10_members_only():
    """``send_parts`` with a LoRA adapter (protocol 1.10): the broadcaster holds the version with its
    adapter, every announce of it carries it, and a 1.9 generator is announced nothing (told in the
    log, once); the next full-weight version goes to both, with no adapter."""
    from types import SimpleNamespace

    from april_async.broadcaster.actor import BroadcasterActor
    from april_async.broadcaster.config import BroadcasterConfig
    from april_async.broadcaster.rounds import Log, Send, StartCollective

    adapter = m.AdapterSpec(base_digest="blake3-128:" + "c3" * 16, rank=4, alpha=8.0,
                            target_modules=["q_proj"])
    lora = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 64), 0.5),
            "model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((64, 4), -0.25)}
    hub = _Hub()
    actor = BroadcasterActor(BroadcasterConfig(store_port=0, backend="gloo", bucket_mb=256 / (1 << 20)), hub,
                             NoBroker)
    ids = iter(range(1000))
    now = time.monotonic()

    def handle(sender, body, proto="1.10"):
        actor.handle(sender.encode(), SimpleNamespace(body=body, sender=sender, msg_id=f"m{next(ids)}",
                                                      msg_type=body.msg_type, proto_version=proto), now)

    def round_of(version):
        """The held version's digests in, the effects of a round starting (not carried out: no group)."""
        assert actor._digest_job is not None and actor._digest_job[2].wait(10)
        actor._take_digests(now)
        return actor.planner.tick(now)

    handoff = WeightHandoff("learner-0", _Capture, lambda: (0, None), mode="zmq")
    try:
        handle("learner-0", m.Hello(role="learner", instance="learner-0", policy_version=0))
        handle("gen-new", m.Hello(role="generator", instance="gen-new", policy_version=0), proto="1.10")
        handle("gen-old", m.Hello(role="generator", instance="gen-old", policy_version=0), proto="1.9")
        specs, total, parts, n = state_parts(lora, bucket_bytes=1 << 10)
        assert n == 2
        handoff.send_parts(1, specs, total, parts, n, adapter=adapter)
        assert [(u.part, u.adapter) for u in handoff.peer.sent if isinstance(u, m.WeightsUpdate)] == [
            (0, adapter), (1, None)]
        for body in handoff.peer.sent:
            if isinstance(body, m.WeightsUpdate):
                handle("learner-0", body)
        assert actor.held.version == 1 and actor.held.adapter == adapter
        assert actor.planner.held.adapter == adapter
        assert actor.held.data.numpy().tobytes() == flatten(lora)[1].numpy().tobytes()  # the bytes unchanged
        effects = round_of(1)
        announces = {e.name: e.body for e in effects if isinstance(e, Send)}
        assert list(announces) == ["gen-new"] and announces["gen-new"].adapter == adapter
        assert announces["gen-new"].tensors == specs and announces["gen-new"].digest_alg == m.BLAKE3_128
        (left,) = [e for e in effects if isinstance(e, Log) and e.event == "adapter_not_announced"]
        assert left.fields["member"] == "gen-old" and "protocol 1.9" in left.fields["why"]
        (start,) = [e for e in effects if isinstance(e, StartCollective)]
        assert start.root.world_size == 2
        actor.planner.round = None  # the round is not run here: only what it would announce matters

        handoff.send(2, {name: t + 1 for name, t in lora.items()})  # full weights, as before 1.10
        handle("learner-0", handoff.peer.sent[-1])
        assert actor.held.adapter is None and actor.planner.held.adapter is None
        announces = {e.name: e.body for e in round_of(2) if isinstance(e, Send)}
        assert sorted(announces) == ["gen-new", "gen-old"]
        assert all(a.adapter is None for a in announces.values())
        assert not [b for b in hub.sent if isinstance(b, m.Error)]
    finally:
        actor.close()
