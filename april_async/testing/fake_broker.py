"""A stand-in for the broker where a test or a tool needs only its replies: a real ``Hub`` that
answers every message with a heartbeat and records what the broadcaster tells the broker.

For generator tests it can also hand out leases (``lease``), keep every token report a generator
sends (``reports``), and speak an older protocol minor than this code's (``proto_version``), as a
broker of an earlier release would. ``NoBroker`` is an actor's broker link where a test runs no
broker at all."""

from __future__ import annotations

import time

import msgspec
import zmq

from april_async.config import LinkConfig
from april_async.transport.hub import Hub
from april_async.wire import messages as m
from april_async.wire.codec import Message, encode


class NoBroker:
    """An actor's broker link (a ``Peer``'s interface) with no broker behind it: what is sent goes
    nowhere, a poll waits a little (no busy loop) and brings nothing."""

    def __init__(self, on_connect):
        on_connect(self)

    def send(self, body, parent_id=None) -> int:
        return 0

    def poll(self, timeout_s):
        time.sleep(min(timeout_s, 0.01))

    def close(self) -> None:
        pass


class FakeBroker:
    def __init__(self, link: LinkConfig, *, proto_version: str | None = None):
        self.hub = Hub("tcp://127.0.0.1:0", link=link, name="broker")
        self.proto_version = proto_version
        """The ``MAJOR.MINOR`` stamped on every message sent; None: this code's own."""
        self.published: list[int] = []
        """Versions in the order ``weights_published`` announced them (repeats kept)."""
        self.published_at: dict[int, float] = {}
        """When (``time.monotonic``) each version was first announced."""
        self.hello_versions: list[int | None] = []
        """The ``policy_version`` of every ``hello``."""
        self.reports: list[Message] = []
        """Every ``token_chunk``, ``progress`` and ``finished`` received, in order."""
        self.peers: dict[str, bytes] = {}
        """Routing id of each sender, from its ``hello``."""
        self.seq = 0  # of the messages sent under ``proto_version`` (one count for all peers)

    @property
    def endpoint(self) -> str:
        return self.hub.endpoint

    def send(self, identity: bytes, body: m.Body) -> None:
        """Send ``body`` to one peer, under ``proto_version`` when one is set (a peer gone is skipped,
        as ``Hub.send`` skips it)."""
        if self.proto_version is None:
            self.hub.send(identity, body)
            return
        self.seq += 1
        frames = encode(body, sender=self.hub.name, seq=self.seq)
        envelope = msgspec.msgpack.decode(frames[0])
        envelope["proto_version"] = self.proto_version
        try:
            self.hub.sock.send_multipart([identity, msgspec.msgpack.encode(envelope), *frames[1:]])
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone
            pass

    def lease(self, peer: str, body: m.Generate) -> None:
        """Send a ``generate`` to the generator named ``peer`` (it must have said hello)."""
        self.send(self.peers[peer], body)

    def pump(self, seconds: float = 0.0) -> None:
        """Serve for ``seconds`` (at least one poll)."""
        until = time.monotonic() + seconds
        while True:
            for identity, msg in self.hub.poll(min(0.02, max(seconds, 0.0))):
                if isinstance(msg.body, m.WeightsPublished):
                    self.published.append(msg.body.version)
                    self.published_at.setdefault(msg.body.version, time.monotonic())
                elif isinstance(msg.body, m.Hello):
                    self.hello_versions.append(msg.body.policy_version)
                    self.peers[msg.sender] = identity
                elif isinstance(msg.body, m.TokenChunk | m.Progress):  # finished is a token_chunk
                    self.reports.append(msg)
                self.send(identity, m.Heartbeat())
            if time.monotonic() >= until:
                return

    def close(self) -> None:
        self.hub.close()
