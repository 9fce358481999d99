"""The learner's side of the weight hand-off: one session on the broadcaster's hub. The receiving
half, the broadcaster's, is ``weights.handoff_recv``.

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

LoRA adapters (protocol 1.10). A version may be an adapter rather than full weights: ``send`` and
``send_parts`` take ``adapter``, an ``AdapterSpec`` naming the base checkpoint (by its content
digest), rank, alpha and target modules, and the version's tensors are then the adapter's own. It
rides on the (first) ``weights_update`` of the version, by bytes or in shared memory alike; the
bytes, layout and digests are those of any version.

The session says ``hello`` as a learner with the version it holds, read from ``current()``, which
returns ``(version, weights)`` or ``(version, weights, adapter)``. When the broadcaster restarts (a
second session opens), the current version is handed over again, since a new broadcaster holds
nothing, with its adapter: the one ``current()`` names, else the one this process last handed that
version over with (so a learner whose ``current()`` names no adapter still re-sends an adapter
version as one); ``weights`` says how:

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

Same host: shared memory (protocol 1.7). A broadcaster that takes hand-offs in shared memory says
so in its ``welcome`` (``host_id``, its host's identity, ``weights.shm.host_id``). With ``mode``
``auto`` (the default) a learner whose own host id is the same writes each version into a region
of ``/dev/shm`` (``weights.shm.ShmRegion``) instead of a ZeroMQ frame, and sends a
``weights_update`` that names the region (``region``; ``data`` empty): the one copy is the copy
into the region, and nothing crosses a socket. ``shm`` uses shared memory whenever the broadcaster
offers it, whatever the ids say; ``zmq`` never does. A version in parts goes into the region too:
each part is copied in at its offset, or produced there in place (``part_target``).

The regions are double-buffered (``slots``, default 2): the broadcaster reads one (the version it
holds, which it keeps for generators that join later, and one it still broadcasts) while the
learner writes the next into another. A region is written again only once the broadcaster has
said it no longer reads it: its heartbeats to the learner list the regions it reads (``regions``),
and a region absent from one whose ``policy_version`` is at least the region's version is free.
With no region free the version goes as bytes (``shm_fallbacks``): the learner never waits for the
broadcaster. Once a region is listed (mapped by the broadcaster) the learner unlinks its name: both
mappings stay valid, and a process killed later leaks no ``/dev/shm`` file. A broadcaster that
cannot open a region, or finds it overwritten, answers ``error`` ``region_unavailable``: the learner
turns shared memory off until its next session, drops its regions and hands the current version
over again as bytes (or sets ``resend_due``). A new broadcaster process (a new ``broker_epoch`` in
its welcome) reads no region: they are all free. Regions are unlinked by ``close`` and, after a
SIGKILL, by the next learner of the same instance name (``shm.remove_stale``).

Used by the learner and by ``tools/bench_broadcast.py``, which measures exactly this hand-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import zmq

from april_async.logs import get_logger
from april_async.runtime import ActorFailed, incarnation
from april_async.weights import shm
from april_async.weights.flat import flatten, layout
from april_async.wire import messages as m
from april_async.wire.version import parse

Part = tuple[int, np.ndarray]
"""``(offset, bytes)``: one consecutive byte range of a version's buffer."""
PartsFactory = Callable[[], tuple[list[m.TensorSpec], int, Iterable[Part], int]]
"""Makes ``(specs, total_bytes, parts, num_parts)``: the arguments of ``send_parts`` after the version."""
Weights = Mapping[str, torch.Tensor] | PartsFactory | None
Current = tuple[int, Weights] | tuple[int, Weights, m.AdapterSpec | None]
"""What ``current()`` returns: the version held, its weights, and optionally its adapter (1.10)."""

PARTS_SINCE = (1, 4)  # the protocol version that added hand-offs in parts
HandoffMode = Literal["auto", "shm", "zmq"]
SHM_SLOTS = 2
"""Shared-memory regions per learner: one the broadcaster reads, one the next version goes into."""
EMPTY = np.empty(0, dtype=np.uint8)


@dataclass
class _Slot:
    """One shared-memory region of the learner, and whether the broadcaster may read it."""

    region: shm.ShmRegion
    version: int = -1  # the version last exported from it
    busy: bool = False


class BroadcastRefused(ActorFailed):
    """The broadcaster cannot take this learner's versions (over its size limit, or too old for a
    hand-off in parts): no retry can mend it, so the learner stops with exit status 2."""


class WeightHandoff:
    def __init__(self, name: str, peer_factory, current: Callable[[], Current], *,
                 mode: HandoffMode = "auto", slots: int = SHM_SLOTS):
        """``peer_factory(on_connect)`` returns a connected transport ``Peer`` to the broadcaster;
        ``current()`` gives the version held, its weights and optionally its adapter (read again after
        a reconnect; see the module docstring for what ``weights`` may be). ``mode``, ``slots``: shared
        memory, see there."""
        if mode not in ("auto", "shm", "zmq"):
            raise ValueError(f"mode must be auto, shm or zmq, got {mode!r}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.name = name
        self.mode = mode
        self.max_slots = slots
        self.host_id = shm.host_id() if mode != "zmq" else None
        self.shm_host: str | None = None
        """The broadcaster's ``welcome.host_id`` in this session (None: no shared memory offered)."""
        self.shm_off: str | None = None
        """Why shared memory is off until the next session (a region the broadcaster could not use)."""
        self.shm_sends = 0
        """Versions handed over in shared memory."""
        self.shm_fallbacks = 0
        """Versions sent as bytes although shared memory was on: no region was free."""
        self.last_mode = "zmq"
        """How the last version went: ``shm`` or ``zmq``."""
        self._slots: list[_Slot] = []
        self._parts_slot: _Slot | None = None  # the region a hand-off in parts is being written into
        self._broadcaster_epoch: str | None = None
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
        self._last_adapter: tuple[int, m.AdapterSpec | None] = (-1, None)
        """The last version handed over and its adapter: what a re-send of that version carries."""
        self.log = get_logger(actor="learner", instance=name)
        if mode != "zmq" and (stale := shm.remove_stale(name)):
            self.log.info("shm_stale_removed", regions=stale)
        self.peer = peer_factory(self._on_connect)

    def _current(self) -> tuple[int, Weights, m.AdapterSpec | None]:
        """``current()`` as ``(version, weights, adapter)``: an adapter it does not name is the one
        that version was last handed over with (None: full weights)."""
        got = self.current()
        version, weights = got[0], got[1]
        if len(got) > 2:
            return version, weights, got[2]
        last_version, adapter = self._last_adapter
        return version, weights, adapter if last_version == version else None

    def _on_connect(self, peer) -> None:
        version, weights, _ = self._current()
        peer.send(m.Hello(role="learner", instance=self.name, policy_version=version,
                          incarnation=incarnation()))
        self.sessions += 1
        self.shm_host, self.shm_off = None, None  # until this session's welcome says otherwise
        if self.sessions <= 1 or version <= 0:
            return
        self._resend(peer)  # a restarted broadcaster holds nothing: hand it over again

    def _resend(self, peer) -> None:
        """Hand the current version over again (or name it in ``resend_due``)."""
        version, weights, adapter = self._current()
        if version <= 0:
            return
        self.resend_due = version
        if weights is None:
            self.log.info("resend_due", version=version, adapter=adapter is not None)
        elif isinstance(weights, Mapping):
            self._send(peer, version, weights, adapter)
        else:
            specs, total_bytes, parts, num_parts = weights()
            self._send_parts(peer, version, specs, total_bytes, parts, num_parts, adapter)

    def send(self, version: int, weights: Mapping[str, torch.Tensor],
             adapter: m.AdapterSpec | None = None) -> None:
        """Hand ``weights`` over as ``version``, in one message; ``adapter``: the version is that LoRA
        adapter's tensors (protocol 1.10), not full weights."""
        self._send(self.peer, version, weights, adapter)

    def _send(self, peer, version: int, weights: Mapping[str, torch.Tensor],
              adapter: m.AdapterSpec | None = None) -> None:
        self._check_adapter(version, adapter)
        t0 = time.monotonic()
        if self._use_shm():
            specs, num_bytes = layout((name, t.dtype, t.shape) for name, t in weights.items())
            slot = self._slot(num_bytes)
            if slot is not None:
                slot.region.begin_write()
                flatten(weights, out=slot.region.tensor)  # the one copy, into the region
                self._send_region(peer, version, specs, slot, adapter)
                self.last_send_s = time.monotonic() - t0
                self._handed_over(version, adapter)
                return
        self.last_mode = "zmq"
        # The one copy: the caller may change its weights at once.
        specs, buf = flatten(weights, out=self._reusable())
        self._flat = None
        peer.send(m.WeightsUpdate(version=version, tensors=specs, data=buf.numpy(), adapter=adapter),
                  track=True)
        self._flat = (buf, peer.last_tracker)
        self.last_send_s = time.monotonic() - t0
        self._handed_over(version, adapter)

    def _check_adapter(self, version: int, adapter: m.AdapterSpec | None) -> None:
        """An adapter goes only to a broadcaster of 1.10 or later: an older one ignores the field and
        would announce the adapter's tensors as full weights, which every generator fails to load."""
        if adapter is not None and self.peer_proto is not None and parse(self.peer_proto) < m.ADAPTER_SINCE:
            since = ".".join(map(str, m.ADAPTER_SINCE))
            raise BroadcastRefused(f"the broadcaster speaks protocol {self.peer_proto}: version {version} is "
                                   f"a LoRA adapter, which needs {since} or newer; upgrade the broadcaster, "
                                   f"or hand over full weights")

    def _reusable(self) -> torch.Tensor | None:
        """The last hand-off's buffer when ZeroMQ no longer references it (sent, or dropped), else
        None. Never waits: a version still being written to the socket leaves its buffer alone,
        and the next one gets a new buffer."""
        if self._flat is None:
            return None
        buf, tracker = self._flat
        return buf if tracker is None or tracker.done else None

    def send_parts(self, version: int, specs: list[m.TensorSpec], total_bytes: int, parts: Iterable[Part],
                   num_parts: int | None = None, adapter: m.AdapterSpec | None = None) -> None:
        """Hand ``version`` over in parts: ``parts`` yields ``(offset, uint8 array)`` in order, ranges
        of the buffer laid out by ``specs`` (``total_bytes`` long) without gaps, ``num_parts`` of
        them (default ``len(parts)``). Returns when the last part is released (or its wait timed
        out). A producer that yields a range not following the one before, or a number of ranges
        other than ``num_parts``, gets a ``ValueError`` (the broadcaster drops the part-built
        version); see the module docstring for when a producer may reuse an array. ``adapter``: the
        version is that LoRA adapter's tensors (protocol 1.10), said in part 0."""
        self._send_parts(self.peer, version, specs, total_bytes, parts, num_parts, adapter)

    def _send_parts(self, peer, version: int, specs: list[m.TensorSpec], total_bytes: int, parts: Iterable[Part],
                    num_parts: int | None, adapter: m.AdapterSpec | None = None) -> None:
        if num_parts is None:
            num_parts = len(parts)
        if num_parts < 1:
            raise ValueError(f"version {version}: a hand-off has at least one part, got num_parts={num_parts}")
        self._check_adapter(version, adapter)
        slot = self._slot(total_bytes) if self._use_shm() else None
        if slot is not None:
            slot.region.begin_write()
            self._parts_slot = slot
            try:
                self._parts_into(peer, slot, version, specs, total_bytes, parts, num_parts, adapter)
            finally:
                self._parts_slot = None
            return
        if num_parts > 1 and self.peer_proto is not None and parse(self.peer_proto) < PARTS_SINCE:
            raise BroadcastRefused(f"the broadcaster speaks protocol {self.peer_proto}: a hand-off in {num_parts} "
                                   f"parts needs 1.4 or newer; upgrade it, or raise learner.gather_bucket_mb above "
                                   f"{total_bytes / (1 << 20):.0f} MiB so that a version goes in one part")
        t0 = time.monotonic()
        self.last_mode = "zmq"

        def emit(k: int, offset: int, data: np.ndarray) -> bool:
            first = k == 0
            peer.send(m.WeightsUpdate(version=version, tensors=list(specs) if first else [], data=data,
                                      part=k, parts=num_parts, offset=offset,
                                      total_bytes=total_bytes if first else 0,
                                      adapter=adapter if first else None),
                      track=True)
            del data  # ours is not the reference that matters: ZeroMQ's is, which the tracker follows
            return self._released(peer, version, k)

        _each_part(version, total_bytes, parts, num_parts, emit)
        self.last_send_s = time.monotonic() - t0
        self._handed_over(version, adapter)

    def _parts_into(self, peer, slot: _Slot, version: int, specs: list[m.TensorSpec], total_bytes: int,
                    parts: Iterable[Part], num_parts: int, adapter: m.AdapterSpec | None = None) -> None:
        """A hand-off in parts through shared memory: each part copied into the region at its
        offset (not at all when it was produced there, ``part_target``), then one update."""
        t0 = time.monotonic()
        region = slot.region.data
        base = region.ctypes.data

        def emit(k: int, offset: int, data: np.ndarray) -> bool:
            if data.nbytes and not (data.ctypes.data == base + offset and data.flags.c_contiguous):
                region[offset:offset + data.nbytes] = data.reshape(-1).view(np.uint8)
            return True  # copied (or already in place): the producer may write into its array again

        _each_part(version, total_bytes, parts, num_parts, emit)
        self._send_region(peer, version, specs, slot, adapter)
        self.last_send_s = time.monotonic() - t0
        self._handed_over(version, adapter)

    def part_target(self, start: int, stop: int) -> np.ndarray | None:
        """Where a producer of ``send_parts`` may write bytes ``[start, stop)`` of the version being
        handed over so that they need no copy: a view of the shared-memory region, or None (then
        it yields arrays of its own). Valid only while that ``send_parts`` runs."""
        slot = self._parts_slot
        return None if slot is None else slot.region.data[start:stop]

    # ------------------------------------------------------------------ shared memory

    @property
    def free_regions(self) -> int:
        """Regions the broadcaster no longer reads: the next version may go into one of them."""
        return sum(not slot.busy for slot in self._slots)

    def _use_shm(self) -> bool:
        """Whether this version may go through shared memory (see the module docstring)."""
        if self.mode == "zmq" or self.shm_host is None or self.shm_off is not None:
            return False
        return self.mode == "shm" or self.shm_host == self.host_id

    def _slot(self, num_bytes: int) -> _Slot | None:
        """A region of ``num_bytes`` the broadcaster does not read: a free one, else a new one
        while there are fewer than ``max_slots``, else None (the version goes as bytes). A free
        region of another size (the layout changed) is dropped. A region that cannot be made
        turns shared memory off for the session."""
        for slot in self._slots:
            if not slot.busy and slot.region.nbytes == num_bytes:
                return slot
        for slot in [s for s in self._slots if not s.busy]:
            slot.region.close()
            self._slots.remove(slot)
        if len(self._slots) >= self.max_slots:
            self.shm_fallbacks += 1
            self.log.info("shm_no_free_region", regions=len(self._slots), hint="the version goes as bytes")
            return None
        try:
            slot = _Slot(shm.ShmRegion.create(self.name, num_bytes))
        except shm.RegionError as e:
            self._shm_failed(str(e))
            return None
        self._slots.append(slot)
        return slot

    def _send_region(self, peer, version: int, specs: list[m.TensorSpec], slot: _Slot,
                     adapter: m.AdapterSpec | None = None) -> None:
        handle = slot.region.export(version)
        slot.busy, slot.version = True, version
        peer.send(m.WeightsUpdate(version=version, tensors=list(specs), data=EMPTY, region=handle,
                                  adapter=adapter))
        self.shm_sends += 1
        self.last_mode = "shm"

    def _regions_heard(self, hb: m.Heartbeat) -> None:
        """A broadcaster heartbeat listing the regions it reads: unlink the names it has mapped,
        free the regions it has let go of."""
        held = {(r.name, r.generation) for r in hb.regions or ()}
        for slot in self._slots:
            key = (slot.region.name, slot.region.generation)
            if key in held:
                slot.region.unlink()  # mapped there: the name is no longer needed, and cannot leak
            elif slot.busy and hb.policy_version is not None and hb.policy_version >= slot.version:
                slot.busy = False

    def _shm_failed(self, why: str) -> None:
        """Shared memory failed: off until the next session; the regions are dropped (a mapping the
        broadcaster still reads stays valid), so nothing is written into a region it reads."""
        self.shm_off = why
        self.log.warning("shm_fallback", error=why, hint="versions go as bytes until the next session")
        self._drop_slots()

    def _drop_slots(self) -> None:
        for slot in self._slots:
            slot.region.close()
        self._slots = []

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

    def _handed_over(self, version: int, adapter: m.AdapterSpec | None = None) -> None:
        self._last_adapter = (version, adapter)
        if self.resend_due is not None and version >= self.resend_due:
            self.resend_due = None

    def pump(self) -> None:
        """Serve the session (heartbeats, reconnects), hear which shared-memory regions the
        broadcaster reads, and its errors."""
        while (msg := self.peer.poll(0.0)) is not None:
            self.peer_proto = msg.proto_version
            body = msg.body
            if isinstance(body, m.Welcome):
                if self._broadcaster_epoch not in (None, body.broker_epoch):
                    self._drop_slots()  # a new broadcaster process: it reads none of them
                self._broadcaster_epoch = body.broker_epoch
                self.shm_host = body.host_id
                continue
            if isinstance(body, m.Heartbeat) and body.regions is not None:
                self._regions_heard(body)
            if not isinstance(body, m.Error):
                continue
            if body.code == "region_unavailable":
                self._shm_failed(body.message)
                self._resend(self.peer)
                continue
            if msg.body.code == "too_large":  # every later version would be refused too: stop loudly
                raise BroadcastRefused(f"the broadcaster refused version {self.current()[0]}: {msg.body.message}; "
                                       f"raise broadcaster.max_update_bytes above the model's size")
            self.log.error("broadcaster_error", code=msg.body.code, error=msg.body.message, field=msg.body.field)

    def close(self) -> None:
        try:
            self.peer.send(m.Bye(reason="shutdown"))
            self.peer.close()
        finally:
            self._drop_slots()  # unlinks every name this process made


def _each_part(version: int, total_bytes: int, parts: Iterable[Part], num_parts: int,
               emit: Callable[[int, int, np.ndarray], bool]) -> None:
    """Walk the producer's parts, checking that they are consecutive and cover ``total_bytes`` in
    ``num_parts``; ``emit(k, offset, data)`` hands each on and says whether its array is released
    (told to a generator producer as the value of its ``yield``)."""
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
        released = emit(k, offset, data)
        del data
    try:
        next(it) if tell is None else tell(released)
    except StopIteration:
        pass
    else:
        raise ValueError(f"version {version}: the parts go on past num_parts={num_parts}")
