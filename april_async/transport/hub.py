"""The hub: a ROUTER socket that every actor's DEALER connects to (the broker binds it).

- Every poll has a timeout; each received message is decoded with the typed codec. A bad frame
  is answered with an ``error`` message (code, field, ``parent_id``) and logged; the hub keeps
  serving. (Peers never answer an ``error``, so refusals cannot ping-pong.)
- Duplicates: the highest ``seq`` seen from each sender is kept and a message at or below it is
  dropped and counted. ``hello`` sets the sender's mark to its own seq (a restarted process
  starts again at 1; a reconnected one goes on counting), so a repeated ``hello`` is the one
  message that is never dropped, and a message of an earlier session that arrives after it is.
- Liveness: every message refreshes its sender's expiry (``peer_timeout_s`` on a monotonic
  clock); ``expired_peers`` returns, and forgets, the senders whose expiry has passed.
- Bulk frames of ``ZERO_COPY_MIN_BYTES`` or more (weights) are received without a copy: the
  decoded arrays view ZeroMQ's message. Size limits apply as before (``MAXMSGSIZE`` on the
  socket, ``max_message_bytes`` in ``decode``).
- A peer's routing id is its sender name; ``ROUTER_HANDOVER`` lets a restarted process with
  the same name take its old connection over (and a peer back from a network cut, whose old
  connection this side still thinks is up).
- Partitions: ``send`` never blocks (a dead peer's full queue would stall the whole hub: ZeroMQ's
  ROUTER with ``ROUTER_MANDATORY`` waits for room otherwise), and ZeroMQ's heartbeats close a
  connection that a cut left half-open, with what was queued on it, instead of leaving it to
  TCP's retransmissions (15 minutes and more). The peers send them (``transport/peer.py``: a
  ``PING`` every ``heartbeat_interval_s`` that names ``peer_timeout_s`` as its time to live);
  the hub answers them and closes a connection whose pings stop for that long. The hub sends
  none of its own (no ``HEARTBEAT_IVL`` here): libzmq 4.3.x aborts the whole process
  (``Assertion failed: !_io_error``, stream_engine_base.cpp; libzmq issues #3937, #4364, #4841)
  when its heartbeat timer writes to a connection whose input was stopped. ``ROUTER_HANDOVER``
  stops one: the old connection of a peer that connected again (back from a network cut, or
  before its old connection closed) loses its pipe, and the next message still arriving on it
  stops its input. The three-host soak (issue 42, ``tools/chaos.py --hosts 3``) aborted a broker
  that way; ``tests/integration/test_transport.py`` does it in a second.
- No receive high-water mark (``RCVHWM`` 0), the other way to stop a connection's input: a peer
  whose messages filled the receive queue and that disconnects before the hub drained them. With
  no limit the queue never fills; what bounds it is the senders (their own send queues,
  ``MAXMSGSIZE`` per message, and with keys only listed clients), and the hub drains it on every
  poll.
- Authentication (``transport/curve.py``): with keys the hub is a CurveZMQ server that admits
  only listed clients, and logs every refused handshake (``auth_refused``); without keys it
  binds loopback addresses only, unless ``link.allow_open``. With a ``roles.toml`` beside the
  keys (``april keys --hosts``) every message's client key is read (ZeroMQ's ``User-Id``
  property, set by the ZAP handler) and a ``hello`` claiming a role that key may not claim is
  refused here, before any service sees it; so is a later message of that sender under another
  key. Nothing of a refused message is kept: no seq mark, no expiry.
"""

from __future__ import annotations

import time
from collections import Counter

import zmq

from april_async.config import LinkConfig
from april_async.logs import get_logger
from april_async.transport import curve
from april_async.wire import messages as m
from april_async.wire.codec import decode, encode
from april_async.wire.errors import WireError

HARD_LIMIT_FACTOR = 4
"""ZeroMQ drops a connection that sends more than max_message_bytes × this in one message; below
it, an oversized message is refused politely with ``too_large``."""
MAX_BATCH = 256
"""Messages taken per poll before control returns to the caller's loop."""
ZERO_COPY_MIN_BYTES = 64 * 1024
"""A bulk frame this large is received without a copy (``Hub._recv_frames``); a smaller one is
cheaper copied into ``bytes`` than kept as a ZeroMQ message (pyzmq's own send threshold is the same)."""


class Hub:
    def __init__(self, bind: str, *, link: LinkConfig = LinkConfig(), name: str = "broker",
                 ctx: zmq.Context | None = None, clock=time.monotonic):
        self.link, self.name, self.clock = link, name, clock
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, link.max_message_bytes * HARD_LIMIT_FACTOR)
        # No HEARTBEAT_IVL: the peers ping, with a time to live (see the module docstring: libzmq
        # aborts a process whose own heartbeat writes to a connection whose input stopped).
        self.sock.setsockopt(zmq.RCVHWM, 0)  # see the module docstring: a full queue stops input
        self.secure = curve.serve(self.sock, self.ctx, link.keys, bind, allow_open=link.allow_open)
        self.monitor = curve.HandshakeMonitor(self.sock) if self.secure else None
        try:
            self.endpoint = curve.bind(self.sock, bind)
        except zmq.ZMQError as e:
            self.sock.close()
            hint = " (another actor, or another run's, is listening there)" if e.errno == zmq.EADDRINUSE else ""
            raise OSError(e.errno, f"{name}: cannot bind {bind}: {e.strerror}{hint}") from None
        self.log = get_logger(actor=name, component="hub")
        self.refusals = curve.RefusalLog(self.log, self.clock)
        self.key_roles = curve.load_roles(link.keys) if self.secure else None
        self.peer_keys: dict[str, str | None] = {}  # sender -> the client key of its hello (with key_roles)
        self.highest_seq: dict[str, int] = {}
        self.expiry: dict[str, float] = {}
        self.identities: dict[str, bytes] = {}
        self._out_seq: Counter[bytes] = Counter()
        self.before_send = None  # called before every send (the broker commits its journal there)
        self.counters: Counter[str] = Counter()

    def poll(self, timeout_s: float) -> list[tuple[bytes, m.Body]]:
        """Messages received within ``timeout_s`` (at most MAX_BATCH), as (routing id, message)."""
        if self.monitor is not None:
            self._refusals()
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return []
        out = []
        for _ in range(MAX_BATCH):
            try:
                frames, key = self._recv_frames()
            except zmq.Again:
                break
            msg = self._accept(frames, key)
            if msg is not None:
                out.append((frames[0], msg))
        return out

    def _recv_frames(self) -> tuple[list[bytes | memoryview], str | None]:
        """One message's frames, and its client key when roles are bound to keys (else None);
        raises ``zmq.Again`` when none is waiting.

        The routing id and the envelope come as ``bytes`` (the hub's traffic is many small
        messages, for which pyzmq's bytes are far cheaper than ``Frame`` objects). A bulk frame
        (frame 2 on) of ``ZERO_COPY_MIN_BYTES`` or more is not copied: it comes as a memoryview of
        ZeroMQ's own message, which lives as long as the arrays decoded from it (a weights version
        is held by the broadcaster for a whole round; copying 400 MB out took 0.2 s of its loop).
        pyzmq's ``recv_multipart`` is this same loop of ``recv`` calls, so small messages pay nothing."""
        key = None
        if self.key_roles is None:
            frames: list[bytes | memoryview] = [self.sock.recv(zmq.NOBLOCK)]
        else:  # a Frame, for its metadata; the routing id carries the message's
            first = self.sock.recv(zmq.NOBLOCK, copy=False)
            frames, key = [first.bytes], first.get("User-Id")
        while self.sock.getsockopt(zmq.RCVMORE):
            if len(frames) < 2:
                frames.append(self.sock.recv(zmq.NOBLOCK))
                continue
            frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            frames.append(frame.buffer if len(frame) >= ZERO_COPY_MIN_BYTES else frame.bytes)
        return frames, key

    def _refusals(self) -> None:
        """Count and log every handshake the CurveZMQ layer refused since the last poll."""
        for event in self.monitor.events():
            self.counters["auth_refused"] += 1
            self.refusals.note(event)

    def _accept(self, frames: list[bytes], key: str | None = None):
        identity = frames[0]
        self.counters["received"] += 1
        try:
            msg = decode(frames[1:], max_message_bytes=self.link.max_message_bytes)
        except WireError as e:
            self.counters["bad_frames"] += 1
            self.log.warning("bad_frame", peer=identity.decode(errors="replace"), code=e.code, field=e.field, error=e.message)
            self._reply_error(identity, e)
            return None
        sender = msg.sender
        if self.key_roles is not None and (why := self._key_refusal(msg, key)) is not None:
            self.counters["key_refused"] += 1
            self.log.warning("key_refused", peer=sender, msg_type=msg.msg_type, error=why)
            if msg.msg_type != "error":  # an error is never answered with another
                self.send(identity, m.Error(code="refused", message=why[:500]), parent_id=msg.msg_id)
                self.counters["errors_sent"] += 1
            return None
        if msg.msg_type == "hello":
            # A new session (or a restarted process, which starts again at 1). Messages of an
            # earlier session of the same process still in flight on its old connection have a
            # lower seq and are dropped below: acting on them would be wrong, and letting their
            # seq raise the mark would drop this session's next messages as duplicates.
            self.highest_seq[sender] = msg.seq
        elif msg.seq <= self.highest_seq.get(sender, 0):
            self.counters["dropped_duplicates"] += 1
            return None
        else:
            self.highest_seq[sender] = msg.seq
        self.expiry[sender] = self.clock() + self.link.peer_timeout_s
        self.identities[sender] = identity
        return msg

    def _key_refusal(self, msg, key: str | None) -> str | None:
        """Why a message under client ``key`` is refused, or None: any message, a ``hello`` included,
        of a sender that said hello under another key (a host speaking in another's name; the
        binding lasts until the sender expires), or a ``hello`` claiming a role that key may not
        claim (``curve.KeyRoles``). A hello accepted binds its sender to the key."""
        bound = self.peer_keys.get(msg.sender, key)
        if bound != key:
            return (f"{msg.sender!r} said hello from host {self.key_roles.host(bound)!r}; this message comes "
                    f"from host {self.key_roles.host(key)!r}")
        if msg.msg_type == "hello":
            why = self.key_roles.refusal(key, msg.body.role)
            if why is None:
                self.peer_keys[msg.sender] = key
            return why
        return None

    def _reply_error(self, identity: bytes, e: WireError) -> None:
        # Peers never answer an ``error``, so a refusal cannot start a ping-pong.
        self.send(identity, m.Error(code=e.code, message=e.message[:500], field=e.field), parent_id=e.msg_id)
        self.counters["errors_sent"] += 1

    def send(self, identity: bytes, body: m.Body, parent_id: str | None = None) -> bool:
        """Send to one peer; False (logged) when it is not connected."""
        if self.before_send is not None:
            self.before_send()
        self._out_seq[identity] += 1
        frames = encode(body, sender=self.name, seq=self._out_seq[identity], parent_id=parent_id)
        try:
            self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone; EAGAIN: its queue is full (a dead connection)
            self.counters["unroutable"] += 1
            self.log.debug("unroutable", peer=identity.decode(errors="replace"), error=str(e))
            return False
        self.counters["sent"] += 1
        return True

    def expired_peers(self, now: float) -> list[str]:
        """Senders silent for longer than ``peer_timeout_s``; each is reported once."""
        dead = [name for name, t in self.expiry.items() if t < now]
        for name in dead:
            del self.expiry[name]
            self.highest_seq.pop(name, None)
            self.peer_keys.pop(name, None)
        return dead

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.sock.close(linger=0)
