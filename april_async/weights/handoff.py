"""The learner's side of the weight hand-off: one session on the broadcaster's hub.

Two ways to hand a version over:

- ``send(version, state_dict)``: the weights are copied once into a flat buffer
  (``flat.flatten``) and handed over as one ``weights_update``; training may go on at once. The
  buffer is sent without a copy and reused for the next version once ZeroMQ has let go of it
  (its tracker is done) and the layout's size is unchanged; else a new one is made.
- ``send_parts(version, specs, total_bytes, parts)``: for a learner that never holds the whole
  buffer (rank 0 of an FSDP2 group gathers the weights range by range). ``specs`` and
  ``total_bytes`` are the layout (``flat.layout``); ``parts`` yields ``(offset, array)``, the
  buffer's consecutive byte ranges in order as 1-D uint8 numpy arrays (one per
  ``flat.tensor_buckets`` range, say), each sent without a copy as one part of the version
  (protocol 1.4). The iterator is advanced only once ZeroMQ no longer references the array it
  yielded before, so a producer has at most one range in flight.

  That wait lasts at most the link's ``peer_timeout_s``; past it, a warning is logged and the
  next part is asked for anyway, while ZeroMQ may still read the old array. So a producer that
  wants to reuse its array is told whether it may: a generator receives, as the value of its
  ``yield``, True when the array it yielded was released (write into it again) and False when
  not (it MUST NOT write into it; yield a fresh one). A plain iterator is told nothing and must
  yield a fresh array every time::

      def parts():
          buf = None
          for start, stop, indices in flat.tensor_buckets(specs, bucket_bytes):
              if buf is None or buf.nbytes < stop - start:
                  buf = np.empty(stop - start, np.uint8)
              view = buf[: stop - start]
              ...  # gather the tensors ``indices`` into ``view``
              if not (yield start, view):
                  buf = None  # still referenced by ZeroMQ: never write into it again

The session says ``hello`` as a learner with the version it holds, read from ``current()``, which
returns ``(version, weights)``. When the broadcaster restarts (a second session opens), the
current version is handed over again, since a new broadcaster holds nothing; ``weights`` says how:

- a state dict: handed over with ``send``;
- a parts factory, a callable with no argument that returns ``(specs, total_bytes, parts,
  num_parts)``: handed over with ``send_parts``. It runs where the reconnect happens, inside
  ``pump()`` on this process alone, so it must not need the other ranks;
- ``None``: this process cannot produce the weights on its own (an FSDP2 gather needs every
  rank). ``resend_due`` then names the version the learner's loop must hand over again, with
  every rank, at its next chance.

``resend_due`` is set by every reconnect that needs a hand-off and cleared by the hand-off of that
version or a newer one, whichever way it is made. ``pump`` keeps the session alive and raises
``BroadcastRefused`` when the broadcaster says that no version can ever fit (``too_large``); other
errors are logged. (An ``error`` ``refused``, the broadcaster's answer to a part sequence it could
not assemble, re-opens the session inside the ``Peer``, which hands the current version over again.)

Used by the learner and by ``tools/bench_broadcast.py``, which measures exactly this hand-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
import zmq

from april_async.logs import get_logger
from april_async.runtime import ActorFailed
from april_async.weights.flat import flatten
from april_async.wire import messages as m
from april_async.wire.version import parse

Part = tuple[int, np.ndarray]
"""``(offset, bytes)``: one consecutive byte range of a version's buffer."""
PartsFactory = Callable[[], tuple[list[m.TensorSpec], int, Iterable[Part], int]]
"""Makes ``(specs, total_bytes, parts, num_parts)``: the arguments of ``send_parts`` after the version."""
Weights = Mapping[str, torch.Tensor] | PartsFactory | None

PARTS_SINCE = (1, 4)  # the protocol version that added hand-offs in parts


class BroadcastRefused(ActorFailed):
    """The broadcaster cannot take this learner's versions (over its size limit, or too old for a
    hand-off in parts): no retry can mend it, so the learner stops with exit status 2."""


class WeightHandoff:
    def __init__(self, name: str, peer_factory, current: Callable[[], tuple[int, Weights]]):
        """``peer_factory(on_connect)`` returns a connected transport ``Peer`` to the broadcaster;
        ``current()`` gives the version held and its weights (read again after a reconnect; see the
        module docstring for what ``weights`` may be)."""
        self.name = name
        self.current = current
        self.sessions = 0
        self.resend_due: int | None = None
        """A version the broadcaster lost (it restarted) that ``current()`` could not hand over again."""
        self.last_send_s = 0.0
        """Seconds of the last hand-off: the copy, the encoding and the queueing (with parts: every
        part's production too, and the waits for ZeroMQ to release each)."""
        self.peer_proto: str | None = None
        """The protocol version of the broadcaster's last message (parts need 1.4 or newer)."""
        self.unreleased = 0
        """Parts whose bytes ZeroMQ still referenced when the next was asked for (since start)."""
        self._flat: tuple[torch.Tensor, zmq.MessageTracker | None] | None = None
        """The buffer of the last one-message hand-off and its send's tracker (``_reusable``)."""
        self.log = get_logger(actor="learner", instance=name)
        self.peer = peer_factory(self._on_connect)

    def _on_connect(self, peer) -> None:
        version, weights = self.current()
        peer.send(m.Hello(role="learner", instance=self.name, policy_version=version))
        self.sessions += 1
        if self.sessions <= 1 or version <= 0:
            return
        self.resend_due = version  # a restarted broadcaster holds nothing: hand it over again
        if weights is None:
            self.log.info("resend_due", version=version)
        elif isinstance(weights, Mapping):
            self._send(peer, version, weights)
        else:
            specs, total_bytes, parts, num_parts = weights()
            self._send_parts(peer, version, specs, total_bytes, parts, num_parts)

    def send(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Hand ``weights`` over as ``version``, in one message."""
        self._send(self.peer, version, weights)

    def _send(self, peer, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        t0 = time.monotonic()
        # The one copy: the caller may change its weights at once.
        specs, buf = flatten(weights, out=self._reusable())
        self._flat = None
        peer.send(m.WeightsUpdate(version=version, tensors=specs, data=buf.numpy()), track=True)
        self._flat = (buf, peer.last_tracker)
        self.last_send_s = time.monotonic() - t0
        self._handed_over(version)

    def _reusable(self) -> torch.Tensor | None:
        """The last hand-off's buffer when ZeroMQ no longer references it (sent, or dropped), else
        None. Never waits: a version still being written to the socket leaves its buffer alone,
        and the next one gets a new buffer."""
        if self._flat is None:
            return None
        buf, tracker = self._flat
        return buf if tracker is None or tracker.done else None

    def send_parts(self, version: int, specs: list[m.TensorSpec], total_bytes: int, parts: Iterable[Part],
                   num_parts: int | None = None) -> None:
        """Hand ``version`` over in parts: ``parts`` yields ``(offset, uint8 array)`` in order, ranges
        of the buffer laid out by ``specs`` (``total_bytes`` long) without gaps, ``num_parts`` of
        them (default ``len(parts)``). Returns when the last part is released (or its wait timed
        out). A producer that yields a range not following the one before, or a number of ranges
        other than ``num_parts``, gets a ``ValueError`` (the broadcaster drops the part-built
        version); see the module docstring for when a producer may reuse an array."""
        self._send_parts(self.peer, version, specs, total_bytes, parts, num_parts)

    def _send_parts(self, peer, version: int, specs: list[m.TensorSpec], total_bytes: int, parts: Iterable[Part],
                    num_parts: int | None) -> None:
        if num_parts is None:
            num_parts = len(parts)
        if num_parts < 1:
            raise ValueError(f"version {version}: a hand-off has at least one part, got num_parts={num_parts}")
        if num_parts > 1 and self.peer_proto is not None and parse(self.peer_proto) < PARTS_SINCE:
            raise BroadcastRefused(f"the broadcaster speaks protocol {self.peer_proto}: a hand-off in {num_parts} "
                                   f"parts needs 1.4 or newer; upgrade it, or raise learner.gather_bucket_mb above "
                                   f"{total_bytes / (1 << 20):.0f} MiB so that a version goes in one part")
        t0 = time.monotonic()
        it = iter(parts)
        tell = getattr(it, "send", None)  # a generator learns whether it may reuse what it yielded
        released = True
        end = 0
        for k in range(num_parts):
            try:
                offset, data = next(it) if k == 0 or tell is None else tell(released)
            except StopIteration:
                raise ValueError(f"version {version}: the parts ended after {k} of {num_parts}") from None
            if offset != end:
                raise ValueError(f"version {version} part {k}: offset {offset}, expected {end} (where part {k - 1} "
                                 f"ended)" if k else f"version {version} part 0: offset {offset}, expected 0")
            end = offset + data.nbytes
            if end > total_bytes or (k == num_parts - 1 and end != total_bytes):
                raise ValueError(f"version {version} part {k} of {num_parts}: bytes [{offset}, {end}) of a "
                                 f"{total_bytes}-byte buffer")
            peer.send(m.WeightsUpdate(version=version, tensors=list(specs) if k == 0 else [], data=data, part=k,
                                      parts=num_parts, offset=offset, total_bytes=total_bytes if k == 0 else 0),
                      track=True)
            del data  # ours is not the reference that matters: ZeroMQ's is, which the tracker follows
            released = self._released(peer, version, k)
        try:
            next(it) if tell is None else tell(released)
        except StopIteration:
            pass
        else:
            raise ValueError(f"version {version}: the parts go on past num_parts={num_parts}")
        self.last_send_s = time.monotonic() - t0
        self._handed_over(version)

    def _released(self, peer, version: int, part: int) -> bool:
        """Wait (at most ``peer_timeout_s``) until ZeroMQ no longer references the part just sent."""
        tracker = peer.last_tracker
        if tracker is None:  # dropped, not queued: ZeroMQ let go of it at once
            return True
        try:
            tracker.wait(peer.link.peer_timeout_s)
        except zmq.NotDone:
            self.unreleased += 1
            self.log.warning("part_not_released", version=version, part=part, waited_s=peer.link.peer_timeout_s,
                             hint="the producer must not write into that array again")
            return False
        return True

    def _handed_over(self, version: int) -> None:
        if self.resend_due is not None and version >= self.resend_due:
            self.resend_due = None

    def pump(self) -> None:
        """Serve the session (heartbeats, reconnects) and hear the broadcaster's errors."""
        while (msg := self.peer.poll(0.0)) is not None:
            self.peer_proto = msg.proto_version
            if not isinstance(msg.body, m.Error):
                continue
            if msg.body.code == "too_large":  # every later version would be refused too: stop loudly
                raise BroadcastRefused(f"the broadcaster refused version {self.current()[0]}: {msg.body.message}; "
                                       f"raise broadcaster.max_update_bytes above the model's size")
            self.log.error("broadcaster_error", code=msg.body.code, error=msg.body.message, field=msg.body.field)

    def close(self) -> None:
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
