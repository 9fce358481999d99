"""Every message the actors really send reads with a plain MessagePack decoder and its defaults.

A client written from ``proto/SPEC.md`` may use ``msgpack.unpackb(frame)`` with no options, which
refuses a map key that is not a string (``strict_map_key``). This test runs a real broker, a real
broadcaster, real scripted generators and a real scorer as processes; the test process plays the
learner (``BatchClient`` on the broker, a ``Peer`` on the broadcaster) and a generator-side weight
subscriber runs as a process of its own, to receive weights over a real gloo group. Two recording
relays sit between the peers and the two hubs and keep every frame going either way. The run goes
through a batch, an early termination, a new version fanned out, an error reply and clean
shutdowns; then every recorded frame 0 is decoded with ``msgpack.unpackb`` alone and validated
against the JSON Schemas of ``proto/schemas``, and the message types seen must be every type of
``april_async.wire.messages.MESSAGE_TYPES``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import jsonschema
import msgpack
import numpy as np
import pytest
import zmq

from april_async.config import LinkConfig
from april_async.testing.cluster import FAST_LINK, Cluster
from april_async.testing.procs import free_port, spawn, wait_for
from april_async.transport.peer import Peer
from april_async.wire import messages as m

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "proto" / "schemas"
LINK = LinkConfig(**{k.split(".")[1]: v for k, v in FAST_LINK.items()})

# Who sends what (SPEC, the message table): each pair must be seen in the run.
ROLE_SENDS = {
    "broker": {"welcome", "heartbeat", "error", "generate", "abort", "score_request", "batch",
               "weights_published"},
    "broadcaster": {"welcome", "heartbeat", "hello", "weights_announce", "weights_published"},
    "generator": {"hello", "heartbeat", "bye", "token_chunk", "progress", "finished"},
    "scorer": {"hello", "heartbeat", "bye", "scored"},
    "learner": {"hello", "bye", "batch_request", "batch_report", "weights_update", "weights_published"},
}


class Relay:
    """Records every frame between the peers that connect to ``endpoint`` and the hub at ``hub``.

    A ROUTER takes the peers' connections; each peer gets a DEALER of its own, with the peer's
    routing id, on the hub, so that the hub sees one connection per peer as it would without the
    relay. Frames are forwarded unchanged, both ways, and kept in ``frames`` as
    ``(direction, routing id, [frame, ...])``.
    """

    def __init__(self, hub: str):
        self.hub = hub
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.frames: list[tuple[str, bytes, list[bytes]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dealers: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(20):
                    if sock is self.front:
                        rid, *frames = sock.recv_multipart()
                        dealer = dealers.get(rid)
                        if dealer is None:
                            dealer = dealers[rid] = self.ctx.socket(zmq.DEALER)
                            dealer.setsockopt(zmq.LINGER, 0)
                            dealer.setsockopt(zmq.IDENTITY, rid)
                            dealer.connect(self.hub)
                            poller.register(dealer, zmq.POLLIN)
                        self.frames.append(("to_hub", rid, frames))
                        dealer.send_multipart(frames)
                    else:
                        frames = sock.recv_multipart()
                        rid = sock.getsockopt(zmq.IDENTITY)
                        self.frames.append(("from_hub", rid, frames))
                        self.front.send_multipart([rid, *frames])
        finally:
            for dealer in dealers.values():
                dealer.close()
            self.front.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.term()


def role_of(sender: str) -> str:
    for prefix, role in (("gen", "generator"), ("scorer", "scorer"), ("learner", "learner"),
                         ("broadcaster", "broadcaster"), ("broker", "broker")):
        if sender.startswith(prefix):
            return role
    raise AssertionError(f"unexpected sender {sender!r}")


def wait_in(cluster: Cluster, what: str, cond, pump) -> None:
    wait_for(what, cond, 30.0, alive=cluster.assert_alive, logs=cluster.dump_logs, pump=pump, interval_s=0.02)


@pytest.fixture
def run(tmp_path):
    """A real run through the two relays; yields (cluster, broker relay, broadcaster relay)."""
    cluster = Cluster(tmp_path)
    broker_bind = f"tcp://127.0.0.1:{free_port()}"
    weights_bind = f"tcp://127.0.0.1:{free_port()}"
    broker_relay, weights_relay = Relay(broker_bind), Relay(weights_bind)
    cluster.endpoint = broker_relay.endpoint  # every actor reaches the broker through the relay
    try:
        yield cluster, broker_relay, weights_relay, broker_bind, weights_bind
    finally:
        cluster.stop_all()
        broker_relay.close()
        weights_relay.close()


def drive(cluster: Cluster, broker_bind: str, weights_relay: Relay, weights_bind: str, tmp: Path) -> None:
    # B = 1 of n = 2 with r = 2: the second group (long responses) is aborted when the first is done.
    cluster.start("broker", "broker", {
        "bind": broker_bind, **FAST_LINK, "rollout.mode": "april", "rollout.batch_groups": 1,
        "rollout.group_size": 2, "rollout.over_provision": 2.0, "rollout.staleness_bound": 1,
        "rollout.lease_timeout_s": 5.0, "rollout.score_timeout_s": 5.0})
    cluster.start("broadcaster", "broadcaster", {
        "name": "broadcaster", "bind": weights_bind, "link.broker": cluster.endpoint, **FAST_LINK,
        "store_port": free_port(), "backend": "gloo", "bucket_mb": 0.25, "timeout_s": 20.0})
    cluster.generator("gen-0", slots=2, lengths=[4, 4, 200, 200], step_s_fixed=0.01)
    # A generator of the kind before 1.7 (a token_chunk per lease), beside gen-0 (progress messages).
    cluster.start("gen-1", "generator", {"name": "gen-1", "link.broker": cluster.endpoint, **FAST_LINK,
                                         "engine": "scripted", "chunk_tokens": 4, "progress": False,
                                         "scripted.slots": 2, "scripted.lengths": [4, 4, 200, 200],
                                         "scripted.step_s_fixed": 0.01})
    cluster.scorer("scorer-0")
    member = tmp / "gen-w.log"  # a generator-side weight subscriber (the broadcaster's gloo rank 1)
    cluster.procs["gen-w"] = spawn([sys.executable, "-m", "april_async.testing.weights", "member", "--name", "gen-w",
                                    "--endpoint", weights_relay.endpoint, "--out", str(tmp / "gen-w.loads.jsonl")],
                                   log=member)
    cluster.logs["gen-w"] = member

    learner = cluster.learner()
    try:
        batch = None
        deadline = time.monotonic() + 60
        while batch is None:
            assert time.monotonic() < deadline, f"no batch\n{cluster.dump_logs()}"
            cluster.assert_alive()
            batch = learner.next_batch(0.5)
        learner.peer.send(m.BatchReport(batch_id=batch.batch_id, policy_version=1))
        learner.peer.send(m.Abort(all=True))  # the broker takes no abort: it answers with an error

        # The learner hands version 1 to the broadcaster, which fans it out and tells the broker.
        replies: list = []
        hub_peer = Peer(weights_relay.endpoint, "learner-0w", link=LINK, on_connect=lambda p: p.send(
            m.Hello(role="learner", instance="learner-0w", policy_version=0)))
        try:
            def pump():
                while (msg := hub_peer.poll(0.0)) is not None:
                    replies.append(msg.msg_type)
                learner.next_batch(0.0)

            wait_in(cluster, "the broadcaster's welcome", lambda: "welcome" in replies, pump)
            wait_in(cluster, "the weight subscriber's session", lambda: _sent(weights_relay, "gen-w", "hello"), pump)
            data = np.arange(64, dtype="<f4")
            hub_peer.send(m.WeightsUpdate(version=1, tensors=[m.TensorSpec("w", "float32", [64], 0)],
                                          data=data.view(np.uint8)))
            wait_in(cluster, "version 1 at the subscriber", lambda: _heartbeat_version(weights_relay, "gen-w") == 1,
                    pump)
            learner.publish(2)  # the learner's own announcement to the broker
            time.sleep(0.5)
            pump()
            hub_peer.send(m.Bye(reason="done"))
        finally:
            hub_peer.close()
    finally:
        learner.close()  # bye
    time.sleep(0.3)
    cluster.stop_all()  # SIGTERM: generators and the scorer say bye
    time.sleep(0.3)


def _sent_by(relay: Relay, rid: str) -> list[dict]:
    """The envelopes that peers whose routing id starts with ``rid`` sent to the hub, in order."""
    return [msgpack.unpackb(f[0]) for d, r, f in list(relay.frames)
            if d == "to_hub" and r.startswith(rid.encode())]


def _sent(relay: Relay, rid: str, msg_type: str) -> bool:
    return any(env["msg_type"] == msg_type for env in _sent_by(relay, rid))


def _heartbeat_version(relay: Relay, rid: str) -> int | None:
    versions = [env["body"]["policy_version"] for env in _sent_by(relay, rid)
                if env["msg_type"] == "heartbeat" and "policy_version" in env["body"]]
    return versions[-1] if versions else None


def validator(name: str):
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def test_every_message_type_sent_in_a_real_run_reads_with_plain_msgpack(run, tmp_path):
    cluster, broker_relay, weights_relay, broker_bind, weights_bind = run
    drive(cluster, broker_bind, weights_relay, weights_bind, tmp_path)
    envelope_schema = validator("envelope")
    body_schemas = {t: validator(t) for t in m.MESSAGE_TYPES}
    seen: dict[str, set[str]] = {}
    checked = 0
    for relay in (broker_relay, weights_relay):
        for _, _, frames in relay.frames:
            envelope = msgpack.unpackb(frames[0])  # no options: string map keys only
            envelope_schema.validate(envelope)
            msg_type = envelope["msg_type"]
            body_schemas[msg_type].validate(envelope["body"])
            refs = [envelope["body"][name] for name in m.MESSAGE_TYPES[msg_type].bulk_fields]
            assert sorted(r["frame"] for r in refs) == list(range(1, len(frames)))
            for ref in refs:
                assert len(frames[ref["frame"]]) == ref["len"] * np.dtype(ref["dtype"]).itemsize
            seen.setdefault(role_of(envelope["sender"]), set()).add(msg_type)
            checked += 1
    missing_types = set(m.MESSAGE_TYPES) - set().union(*seen.values())
    assert not missing_types, f"no {sorted(missing_types)} in the run ({checked} messages)"
    missing = {role: sorted(types - seen.get(role, set())) for role, types in ROLE_SENDS.items()}
    assert not any(missing.values()), f"not seen: {missing}"
    batch = next(msgpack.unpackb(f[0]) for d, _, f in broker_relay.frames
                 if d == "from_hub" and msgpack.unpackb(f[0])["msg_type"] == "batch")
    assert batch["body"]["stats"]["staleness_tokens"] and all(
        isinstance(k, str) for k in batch["body"]["stats"]["staleness_tokens"])


def test_the_role_table_names_every_message_type():
    """A message type added to the protocol must be added to what this test expects to see."""
    assert set().union(*ROLE_SENDS.values()) == set(m.MESSAGE_TYPES)
