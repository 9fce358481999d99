"""A peer may only send what its role sends (SPEC, *Messages*), over real ZeroMQ sockets.

Every message type of SPEC's table, from every role, to the broker and to the broadcaster: a type
the role may not send is answered ``error`` ``refused`` (``parent_id`` the message's, naming the
role and the type) and changes nothing. The bodies are the golden vectors of ``proto/vectors/``.
Also: one learner (or broadcaster) instance at a time moves the policy version.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq

from april_async.broker.config import BrokerServiceConfig
from april_async.broker.service import BrokerService
from april_async.config import LinkConfig
from april_async.testing.fake_broker import NoBroker
from april_async.transport.hub import Hub
from april_async.wire import codec
from april_async.wire import messages as m
from april_async.wire import roles

VECTORS = Path(__file__).resolve().parents[2] / "proto" / "vectors"
LINK = LinkConfig(heartbeat_interval_s=0.5, peer_timeout_s=30.0)
QUIET_S = 0.03  # how long answers are waited on after the awaited one (or for a message that gets none)


def vector(msg_type: str) -> m.Body:
    """The body of the golden vector of ``msg_type``."""
    return codec.decode(msgpack.unpackb((VECTORS / f"{msg_type}.msgpack").read_bytes())).body


class Served:
    """A service (broker or broadcaster) on a real hub, driven from the test: each ``send`` goes over
    a DEALER, is handled by the service in this thread, and returns the answers that came back."""

    def __init__(self, hub: Hub, service):
        self.hub, self.service = hub, service
        self.sockets: dict[str, zmq.Socket] = {}
        self.seqs: dict[str, int] = {}

    def send(self, sender: str, body: m.Body, *, reply: bool = False) -> tuple[str, list[codec.Message]]:
        """Send ``body`` as ``sender``; the answers: with ``reply``, up to the one that answers it
        (``parent_id``), and whatever follows within ``QUIET_S``."""
        sock = self.sockets.get(sender)
        if sock is None:
            sock = self.sockets[sender] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, sender.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.hub.endpoint)
        self.seqs[sender] = self.seqs.get(sender, 0) + 1
        frames = codec.encode(body, sender=sender, seq=self.seqs[sender])
        msg_id = msgpack.unpackb(bytes(frames[0]))["msg_id"]
        sock.send_multipart(frames, copy=False)
        handled, deadline = False, time.monotonic() + 2.0
        while not handled and time.monotonic() < deadline:
            for identity, msg in self.hub.poll(0.01):
                self.service.handle(identity, msg, time.monotonic())
                handled |= msg.msg_id == msg_id
        assert handled, f"{body.msg_type} from {sender} never reached the service"
        answers, deadline = [], time.monotonic() + 2.0
        while reply and time.monotonic() < deadline and not any(a.parent_id == msg_id for a in answers):
            if sock.poll(10):
                answers.append(codec.decode(sock.recv_multipart()))
        while sock.poll(int(QUIET_S * 1000)):
            answers.append(codec.decode(sock.recv_multipart()))
        return msg_id, answers

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.hub.close()


def refusals(answers: list[codec.Message], msg_id: str) -> list[str]:
    return [a.body.message for a in answers
            if isinstance(a.body, m.Error) and a.body.code == "refused" and a.parent_id == msg_id]


def broker_state(svc: BrokerService) -> tuple:
    """What a refused message must leave as it was: the ledger (policy version included), the
    sessions, the waiting batch requests, the version's movers."""
    return (svc.ledger(), {n: (p.role, p.instance, p.capacity) for n, p in svc.peers.items()},
            list(svc.batch_waiters), dict(svc.version_right.holders), len(svc.core.leases))


@pytest.fixture(scope="module")
def broker():
    cfg = BrokerServiceConfig.model_validate({
        "link": LINK.model_dump(), "prompts": {"limit": 4},
        "rollout": {"mode": "async", "batch_groups": 1, "group_size": 2, "max_response_tokens": 16}})
    served = Served(Hub("tcp://127.0.0.1:0", link=LINK), None)
    served.service = BrokerService(cfg, served.hub)
    yield served
    served.close()


@pytest.mark.parametrize("role", roles.ACTORS)
def test_every_type_from_every_role_to_the_broker(broker, role):
    svc = broker.service
    sender = f"{role}-table"
    _, answers = broker.send(sender, m.Hello(role=role, instance=sender), reply=True)
    assert [a.body.msg_type for a in answers][:1] == ["welcome"], answers
    for msg_type in m.MESSAGE_TYPES:
        if msg_type in ("hello", "bye"):  # the session's first and last
            continue
        before = broker_state(svc)
        refused = not roles.may_send(role, msg_type)
        msg_id, answers = broker.send(sender, vector(msg_type), reply=refused)
        by_role = [t for t in refusals(answers, msg_id) if "may not send" in t]
        if refused:
            assert by_role == [roles.refusal(role, msg_type)], (msg_type, answers)
            assert broker_state(svc) == before, f"a refused {msg_type} from a {role} changed the broker"
        else:
            assert by_role == [], (msg_type, by_role)
    msg_id, answers = broker.send(sender, vector("bye"))
    assert not refusals(answers, msg_id) and sender not in svc.peers


def test_the_users_case_a_generator_announcing_a_version(broker):
    """The report: a generator said weights_published {version: 50}; the broker took it and aborted
    every in-flight sample. Now it is refused and the version stays; its batch_request too."""
    svc = broker.service
    broker.send("gen-rogue", m.Hello(role="generator", instance="gen-rogue"), reply=True)
    version = svc.core.version
    msg_id, answers = broker.send("gen-rogue", m.WeightsPublished(version=version + 50), reply=True)
    assert refusals(answers, msg_id) == [f"a generator may not send weights_published (sent by broker, learner, "
                                         f"broadcaster; proto/SPEC.md, Messages)"]
    assert svc.core.version == version
    msg_id, answers = broker.send("gen-rogue", m.BatchRequest(policy_version=0), reply=True)
    assert refusals(answers, msg_id) == ["a generator may not send batch_request (sent by learner; "
                                         "proto/SPEC.md, Messages)"]
    assert "gen-rogue" not in [w[0] for w in svc.batch_waiters]
    broker.send("gen-rogue", m.Bye())


def test_no_peer_says_hello_as_the_broker(broker):
    msg_id, answers = broker.send("fake-broker", m.Hello(role="broker", instance="b"), reply=True)
    assert refusals(answers, msg_id) == [roles.refusal("broker", "hello")]
    assert "fake-broker" not in broker.service.peers


@pytest.mark.parametrize("role", ["learner", "broadcaster"])
def test_one_instance_of_a_role_moves_the_version_at_a_time(broker, role):
    """A second instance is refused while the first one's session lives, whatever it sends that
    would move the version; a restart of the first (a new sender, the same instance) is not; once
    no session of the first is left, the second takes over."""
    svc = broker.service
    move = (lambda v: m.BatchReport(batch_id=10_000, policy_version=v)) if role == "learner" else \
        (lambda v: m.WeightsPublished(version=v))
    first, restarted, second = f"{role}-a-1", f"{role}-a-2", f"{role}-b-1"
    hello = m.Hello(role=role, instance=f"{role}-a", policy_version=svc.core.version)
    _, answers = broker.send(first, hello, reply=True)
    assert answers[0].body.msg_type == "welcome"
    v = svc.core.version + 1
    msg_id, answers = broker.send(first, move(v))
    assert not refusals(answers, msg_id) and svc.core.version == v

    msg_id, answers = broker.send(second, m.Hello(role=role, instance=f"{role}-b", policy_version=v + 5), reply=True)
    [why] = refusals(answers, msg_id)
    assert f"the {role} '{role}-a' (session '{first}') moves the policy version" in why and f"'{role}-b'" in why
    assert second not in svc.peers and svc.core.version == v
    _, answers = broker.send(second, m.Hello(role=role, instance=f"{role}-b"), reply=True)  # no version: a session
    assert answers[0].body.msg_type == "welcome"
    before = broker_state(svc)
    msg_id, answers = broker.send(second, move(v + 5), reply=True)
    assert len(refusals(answers, msg_id)) == 1 and broker_state(svc) == before

    # the first restarts (kill -9: its old session lives on until it expires) and moves it again
    _, answers = broker.send(restarted, m.Hello(role=role, instance=f"{role}-a", policy_version=v), reply=True)
    assert answers[0].body.msg_type == "welcome"
    msg_id, answers = broker.send(restarted, move(v + 1))
    assert not refusals(answers, msg_id) and svc.core.version == v + 1

    # both sessions of the first gone: the second moves it
    broker.send(first, m.Bye())
    msg_id, answers = broker.send(second, move(v + 2), reply=True)
    assert len(refusals(answers, msg_id)) == 1, "the restarted session still lives"
    broker.send(restarted, m.Bye())
    msg_id, answers = broker.send(second, move(v + 2))
    assert not refusals(answers, msg_id) and svc.core.version == v + 2
    broker.send(second, m.Bye())


@pytest.fixture(scope="module")
def broadcaster():
    from april_async.broadcaster.actor import BroadcasterActor
    from april_async.broadcaster.config import BroadcasterConfig

    hub = Hub("tcp://127.0.0.1:0", link=LINK, name="broadcaster")
    served = Served(hub, None)
    served.service = BroadcasterActor(BroadcasterConfig(store_port=0, backend="gloo", link=LINK.model_dump()),
                                      hub, NoBroker)
    yield served
    served.service.close()
    for sock in served.sockets.values():
        sock.close(linger=0)


@pytest.mark.parametrize("role", ["learner", "generator"])
def test_every_type_from_every_role_to_the_broadcaster(broadcaster, role):
    """The broadcaster's hub takes sessions of learners and generators; each is refused what its
    role may not send, and the held version and the sessions stay as they were."""
    actor = broadcaster.service
    sender = f"{role}-table"
    _, answers = broadcaster.send(sender, m.Hello(role=role, instance=sender), reply=True)
    assert answers and answers[0].body.msg_type == "welcome", answers
    for msg_type in m.MESSAGE_TYPES:
        if msg_type in ("hello", "bye") or roles.may_send(role, msg_type):
            continue
        before = (actor.planner.held_version, dict(actor.planner.sessions), actor.parts.assembly)
        msg_id, answers = broadcaster.send(sender, vector(msg_type), reply=True)
        assert refusals(answers, msg_id) == [roles.refusal(role, msg_type)], (msg_type, answers)
        assert (actor.planner.held_version, dict(actor.planner.sessions), actor.parts.assembly) == before
    broadcaster.send(sender, m.Bye())


def test_one_learner_instance_hands_versions_to_the_broadcaster(broadcaster):
    """A second learner instance's weights_update is refused while the first one's session lives,
    and the held version stays; once the first has left, the second's is taken."""
    import msgspec

    actor = broadcaster.service
    update = vector("weights_update")
    for sender in ("learner-a-1", "learner-b-1"):
        _, answers = broadcaster.send(sender, m.Hello(role="learner", instance=sender[:-2]), reply=True)
        assert answers[0].body.msg_type == "welcome"
    base = max(actor.planner.held_version or 0, update.version)
    msg_id, answers = broadcaster.send("learner-a-1", msgspec.structs.replace(update, version=base + 1))
    assert not refusals(answers, msg_id) and actor.planner.held_version == base + 1
    msg_id, answers = broadcaster.send("learner-b-1", msgspec.structs.replace(update, version=base + 2), reply=True)
    [why] = refusals(answers, msg_id)
    assert "the learner 'learner-a' (session 'learner-a-1') moves the policy version" in why
    assert actor.planner.held_version == base + 1
    broadcaster.send("learner-a-1", m.Bye())
    msg_id, answers = broadcaster.send("learner-b-1", msgspec.structs.replace(update, version=base + 3))
    assert not refusals(answers, msg_id) and actor.planner.held_version == base + 3
    broadcaster.send("learner-b-1", m.Bye())
