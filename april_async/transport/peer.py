"""A peer: one actor's DEALER socket to the hub, with heartbeats and reconnection.

- ``send`` stamps ``seq`` 1, 2, 3, ... for the life of the process, across reconnects (the
  hub drops a message from an earlier session that arrives after the new ``hello``: its ``seq``
  is lower); the routing id is the sender name.
- ``poll`` always has a timeout; it sends a ``heartbeat`` when nothing was sent for
  ``heartbeat_interval_s``.
- The hub is dead when nothing arrived for ``peer_timeout_s`` (the hub heartbeats every peer);
  what is already waiting in the socket is read first, so a caller that was busy for a while
  does not take a hub whose messages it has not read yet for a dead one. The peer then closes its
  socket (dropping what was queued: a connection that a network cut left half-open would hold it
  for good), and connects a fresh socket after a doubling back-off with jitter, then calls
  ``on_connect(peer)``, which sends ``hello`` (and whatever the actor must re-report). The back-off
  never blocks the caller: ``poll`` returns (after at most its own timeout) while it runs, and
  ``send`` drops what it is given meanwhile. An actor with two peers on one thread (a generator:
  the broker and the broadcaster) serves both while one of them waits; with a sleeping back-off,
  once it grew past ``peer_timeout_s`` each peer's wait made the other's hub look silent, and a
  generator back from a network cut never got a session again (issue 29). An ``error`` with code
  ``refused`` (the hub has no session for us: it restarted) re-opens the session at once.
- ``send`` never blocks for longer than ``heartbeat_interval_s`` (``SEND_TIMEOUT_FACTOR``): a
  message that cannot be queued by then (no connection was ever made — a refused CurveZMQ
  handshake leaves none — or the queue is full) is dropped and logged (``send_dropped``, once per
  streak). What matters is sent again after the reconnect that follows, as after any lost
  connection.
- A handshake the hub refuses (``transport/curve.py``: a key it does not admit, keys on one side
  only, another server key) is logged as ``auth_refused`` with the reason, once per streak of
  refusals (ZeroMQ and the reconnects retry without end), and counted (``auth_refusals``); a
  handshake that succeeds ends the streak. The peer learns it from its socket's monitor, which
  ``poll`` reads without waiting.
- ``send(..., track=True)`` keeps the message's ``zmq.MessageTracker`` in ``last_tracker`` (None
  when the message was dropped): done once ZeroMQ no longer references the bytes of the
  message's last frame, so that their owner may change them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import zmq

from april_async.config import LinkConfig
from april_async.logs import get_logger
from april_async.transport import curve
from april_async.wire import messages as m
from april_async.wire.codec import Message, decode, encode
from april_async.wire.errors import WireError

RECONNECT_BACKOFF_START_S = 0.1
RECONNECT_BACKOFF_MAX_S = 5.0
"""The cap of the wait between two attempts; an attempt itself lasts ``peer_timeout_s`` (the wait
for a ``welcome``), so a peer back from a cut is served again within this plus one attempt."""
SEND_TIMEOUT_FACTOR = 1.0
"""``send`` blocks at most this many ``heartbeat_interval_s``: never so long that a caller's other
peer misses its heartbeats (``peer_timeout_s`` is at least twice the interval)."""
HANDSHAKE_EVENTS = curve.HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED
"""What the peer's socket monitor reports: refused handshakes, and the successes that end a streak."""


def wait_any(handles, timeout_s: float) -> bool:
    """Block until one of ``handles`` (ZeroMQ sockets, or file descriptors) is readable, at most
    ``timeout_s``; True when one is. An actor idle on several links waits on all of them at once,
    rather than on one with the others looked at only after its timeout."""
    poller = zmq.Poller()
    for h in handles:
        if h is not None:  # a peer waiting out its back-off has no socket
            poller.register(h, zmq.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


class Peer:
    def __init__(self, endpoint: str, sender: str, *, link: LinkConfig, on_connect: Callable[[Peer], None],
                 ctx: zmq.Context | None = None, clock=time.monotonic):
        self.endpoint, self.sender, self.link = endpoint, sender, link
        self.on_connect, self.clock = on_connect, clock
        self.ctx = ctx or zmq.Context.instance()
        self.log = get_logger(actor=sender, component="peer")
        self.sock: zmq.Socket | None = None
        self.monitor: curve.HandshakeMonitor | None = None
        self.secure = False  # whether the socket is a CURVE client
        self.auth_refusals = 0  # handshakes the hub refused, all told
        self._refused_reason: str | None = None  # the reason logged for the current streak, if any
        self.backoff_s = RECONNECT_BACKOFF_START_S
        self.reconnect_at: float | None = None  # while the socket is closed: when to connect a new one
        self._dropping = False  # in a streak of dropped sends (logged once)
        self.reconnects = 0
        self.seq = 0  # never reset: see the module docstring
        self.dropped = 0  # messages send() could not queue
        self.last_tracker: zmq.MessageTracker | None = None  # of the last send(track=True)
        self._connect()

    def _connect(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.sender.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(self.link.heartbeat_interval_s * SEND_TIMEOUT_FACTOR * 1000))
        # ZeroMQ's heartbeats, sent from here: the hub closes this connection when its pings stop for
        # peer_timeout_s (a cut left it half-open), and this side likewise when the hub stops
        # answering. No receive limit: a full queue would stop this connection's input, which with
        # heartbeats on makes libzmq abort the process (transport/hub.py).
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.link.heartbeat_interval_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.link.peer_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.link.peer_timeout_s * 1000))
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.secure = curve.connect(self.sock, self.link.keys)
        self.monitor = curve.HandshakeMonitor(self.sock, HANDSHAKE_EVENTS)
        self.sock.connect(self.endpoint)
        self._open_session()

    def _open_session(self) -> None:
        now = self.clock()
        self.last_recv = self.last_send = self.last_hello = now
        self.on_connect(self)

    def send(self, body: m.Body, parent_id: str | None = None, *, track: bool = False) -> int:
        """Send one message; returns its ``seq``. ``track``: see the module docstring."""
        self.seq += 1
        self.last_tracker = None
        if self.sock is None:  # waiting out the back-off: what matters is sent again after the hello
            self._dropped(body, "no connection (reconnecting)")
            return self.seq
        try:
            tracker = self.sock.send_multipart(encode(body, sender=self.sender, seq=self.seq, parent_id=parent_id),
                                               copy=False, track=track)
            if track:
                self.last_tracker = tracker
            self._dropping = False
        except zmq.Again:  # not queued in time: the hub is unreachable or refuses us
            self._dropped(body, "not queued in time")
        self.last_send = self.clock()
        return self.seq

    def _dropped(self, body: m.Body, why: str) -> None:
        self.dropped += 1
        if not self._dropping:
            self._dropping = True
            self.log.warning("send_dropped", msg_type=body.msg_type, endpoint=self.endpoint, why=why,
                             dropped=self.dropped)

    def poll(self, timeout_s: float) -> Message | None:
        """The next message from the hub within ``timeout_s``, or None."""
        now = self.clock()
        if self.sock is None:  # waiting out the back-off: no socket to read, nothing to block on
            if now < self.reconnect_at:
                time.sleep(max(0.0, min(timeout_s, self.reconnect_at - now)))
                if self.clock() < self.reconnect_at:
                    return None
            self._reconnect()
        elif now - self.last_send >= self.link.heartbeat_interval_s:
            self.send(m.Heartbeat())
        self._handshakes()
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            # Only now, with nothing waiting: a message already in the socket is a live hub.
            if self.clock() - self.last_recv > self.link.peer_timeout_s:
                self._lost()
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.last_recv = self.clock()
        self.backoff_s = RECONNECT_BACKOFF_START_S
        try:
            msg = decode([f.buffer for f in frames], max_message_bytes=self.link.max_message_bytes)
        except WireError as e:
            self.log.warning("bad_frame_from_hub", code=e.code, field=e.field, error=e.message)
            return None
        if isinstance(msg.body, m.Error) and msg.body.code == "refused":
            if self.last_recv - self.last_hello > self.link.heartbeat_interval_s:
                self.log.info("session_refused", message=msg.body.message)
                self._open_session()
            return None
        return msg

    def _handshakes(self) -> None:
        """Read the socket monitor: log the first refusal of a streak, count every one. Without
        this a refused peer only says ``hub_silent``, and nobody learns that its key is the cause."""
        for event in self.monitor.events():
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._refused_reason is not None:
                    self.log.info("auth_accepted", endpoint=self.endpoint, refusals=self.auth_refusals)
                self._refused_reason = None
                continue
            self.auth_refusals += 1
            reason = curve.refused_by_hub(event["event"], int(event["value"]), secure=self.secure)
            if reason != self._refused_reason:  # a new streak, or a new cause within one
                self._refused_reason = reason
                self.log.warning("auth_refused", reason=reason, endpoint=self.endpoint, detail=int(event["value"]),
                                 refusals=self.auth_refusals)

    def _close_socket(self) -> None:
        """Close the socket and its monitor, reading the monitor's last events first."""
        self._handshakes()
        self.monitor.close()
        self.sock.close(linger=0)
        self.monitor = self.sock = None

    def _lost(self) -> None:
        """The hub is silent: close the socket now, connect a new one once the back-off is over
        (``poll`` does, without blocking its caller meanwhile)."""
        wait = min(self.backoff_s, RECONNECT_BACKOFF_MAX_S) * random.uniform(0.8, 1.2)
        self.log.warning("hub_silent", endpoint=self.endpoint, reconnect_in_s=round(wait, 3))
        self._close_socket()
        self.reconnect_at = self.clock() + wait
        self.backoff_s = min(self.backoff_s * 2, RECONNECT_BACKOFF_MAX_S)

    def _reconnect(self) -> None:
        """Connect a fresh socket now (closing the current one, if any) and open the session."""
        if self.sock is not None:
            self._close_socket()
        self.reconnect_at = None
        self.reconnects += 1
        self._connect()

    def close(self) -> None:
        if self.sock is not None:
            self._close_socket()


def peer_factory(endpoint: str, sender: str, link: LinkConfig) -> Callable[[Callable[[Peer], None]], Peer]:
    """What an actor's link (to the broker, to the broadcaster) makes its peer with, given its
    ``on_connect``: a ``Peer`` to ``endpoint`` named ``sender``, timed by ``link``."""

    def make(on_connect: Callable[[Peer], None]) -> Peer:
        return Peer(endpoint, sender, link=link, on_connect=on_connect)

    return make
