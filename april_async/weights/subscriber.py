"""A member's side of the weights group (a generator's): receive each version the broadcaster fans out.

``WeightSubscriber`` opens a session on the broadcaster's hub (``hello`` as ``generator`` with the
version the engine holds) and, for each ``weights_announce``:

    join      leave the current group and join the announced one when its epoch is new;
    receive   every bucket of the buffer, from rank 0 (a member that holds the version already
              receives too: a collective needs every rank);
    verify    each bucket against the announce's ``digests`` (protocol 1.6), hashed with its
              ``digest_alg`` (1.7: BLAKE3-128, or BLAKE2b-128 when absent): the group's bytes come
              over gloo/NCCL, unauthenticated, while the announce came over the authenticated
              ZeroMQ channel, so a buffer that does not match, or whose algorithm this process does
              not know, is refused (``weights_refused``) and never loaded; an announce without
              digests (a 1.5 broadcaster) loads unverified;
    load      ``engine.load_weights(views into the buffer, version)`` when the version is newer;
    ack       ``heartbeat`` with the ``policy_version`` the engine now holds. After a failure, the
              same with the version it still holds: the broadcaster then re-forms the group.
              Either is sent only in the session of the announce it answers (below).

The buffer a version is received into is reused for the next version of the same size once the
engine has loaded from it (``BufferPool``): fresh memory would fault in page by page during the
receive. Joining and receiving run on a worker thread, so the generator keeps decoding (and its broker
session keeps its heartbeats) while the bytes move; loading happens in ``poll``, which the
generator calls between decode steps, so a generator is blocked only while it loads. An error
of ``load_weights`` itself propagates to the caller. ``waitables`` are what an idle caller waits
on (the session's socket, and a pipe the worker writes to when a version is in), so that an
announce, and then the received version, are taken at once rather than at its next timeout.

Announces are handled in order. One whose epoch a newer queued announce replaces is skipped (the
broadcaster abandoned that group). A failure, or an ack, is reported only in the session whose announce it
answers: after a re-``hello`` the broadcaster waits for answers to its new announces only, and a
late failure of an old one would read as a failure of the new round.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from april_async.weights.flat import DigestMismatch, check_digests, unflatten
from april_async.weights.group import WeightGroup
from april_async.weights.link import WeightsLink
from april_async.config import LinkConfig
from april_async.logs import get_logger
from april_async.runtime import incarnation
from april_async.wire import messages as m

LEAVE = "leave"  # a job for the worker: leave the current group (the broadcaster restarted)


@dataclass
class Receipt:
    """What the worker made of one announce, for ``poll`` to load and answer."""

    announce: m.WeightsAnnounce
    session: int  # the broadcaster session the announce came in
    state: dict[str, torch.Tensor] | None
    error: BaseException | None
    seconds: float
    buffer: torch.Tensor | None = None  # what ``state`` views: back to the pool once loaded
    again: bool = False  # the announce was sent again: only an answer, with the version now held


class BufferPool:
    """Receive buffers kept across versions: a version of the same size, on the same device, is
    received into the buffer of the one before instead of a new one.

    A new buffer of hundreds of MB is fresh memory whose every page faults in during the receive
    (the fan-out ran at half the raw bucketed rate for it). A buffer is taken by the worker thread
    and given back by the caller's thread once the engine has loaded from it (``load_weights``
    copies into the engine's own tensors), so a version never overwrites one still being loaded:
    when none is free, a new one is made. At most ``keep`` are kept."""

    def __init__(self, keep: int = 1):
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D uint8 buffer of ``num_bytes`` on ``device``: a free one of that size, else new."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() == num_bytes and buf.device == device:
                    return self._free.pop(i)
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` is free again (nothing reads it); the oldest free one goes past ``keep``."""
        with self._lock:
            self._free.append(buffer)
            del self._free[: max(0, len(self._free) - self.keep)]


def _broadcaster_peer(endpoint: str, name: str, link: LinkConfig):
    """The default session factory on the broadcaster's hub."""
    from april_async.transport.peer import Peer

    def make(on_connect):
        return Peer(endpoint, name, link=link, on_connect=on_connect)

    return make


class WeightSubscriber(WeightsLink):
    """``engine`` has ``policy_version`` (int) and ``load_weights(state_dict, version)``; the
    tensors it is given view a receive buffer that a later version is received into
    (``BufferPool``), so ``load_weights`` copies what it keeps (``load_state_dict`` does)."""

    def __init__(self, name: str, endpoint: str, link: LinkConfig, engine, *,
                 device: torch.device | str | None = None, peer_factory=None, address: str | None = None):
        """``device``: where a version is received (the engine's, ``Engine.device``; None: the
        group's default, the CPU for gloo). ``address``: the address this member advertises to the
        group (``weights_address`` of the generator's config; default: found, ``weights.routes``).
        The group's rendezvous store is reached with ``link.keys``, like the broadcaster's hub."""
        self.name, self.engine = name, engine
        self.log = get_logger(actor="generator", instance=name, component="weights")
        self.group = WeightGroup(device=device, keys=link.keys, address=address)
        self.loaded = 0  # versions loaded
        self.failures = 0  # announces whose receive failed (refusals included)
        self.refused = 0  # announces whose bytes did not match their digests
        self._unverified: int | None = None  # the last version logged as loaded without digests
        self.session = 0  # +1 at every hello
        self._broadcaster_epoch: str | None = None  # from its welcome: changes when it restarts
        self._last_tried: tuple[int, int] | None = None  # (epoch, version) of the last announce acted on
        self._jobs: queue.Queue[tuple[m.WeightsAnnounce, int] | str | None] = queue.Queue()
        self._receipts: queue.Queue[Receipt] = queue.Queue()
        self.buffers = BufferPool()
        self._wake_r, self._wake_w = os.pipe()  # a byte: a receipt is waiting (``waitables``)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._receive_loop, daemon=True, name=f"{name}-weights")
        self._thread.start()
        self.peer = (peer_factory or _broadcaster_peer(endpoint, name, link))(self._on_connect)

    def _on_connect(self, peer) -> None:
        self.session += 1
        peer.send(m.Hello(role="generator", instance=self.name, policy_version=self.engine.policy_version,
                          incarnation=incarnation()))

    # ------------------------------------------------------------------ the caller's thread

    def waitables(self) -> list:
        """What a caller with nothing else to do waits on (``transport.peer.wait_any``) before it
        calls ``poll``: the broadcaster session's socket and the worker's wake-up pipe."""
        sock = getattr(self.peer, "sock", None)
        return ([sock] if sock is not None else []) + [self._wake_r]

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Take announces in, load what has arrived; True when a new version was loaded."""
        msg = self.peer.poll(timeout_s)
        while msg is not None:
            if isinstance(msg.body, m.WeightsAnnounce):
                self._jobs.put((msg.body, self.session))
            elif isinstance(msg.body, m.Welcome):
                if self._broadcaster_epoch not in (None, msg.body.broker_epoch):
                    # A restarted broadcaster: whatever the worker does for the old one (a join at its
                    # rendezvous, a receive) can never finish, and would hold every later announce for
                    # up to timeout_s (issue 42: a minute without weights). It is given up now, then
                    # the group left: a restarted broadcaster counts its groups from 1 again.
                    self.group.abandon()
                    self._jobs.put(LEAVE)
                self._broadcaster_epoch = msg.body.broker_epoch
            msg = self.peer.poll(0.0)
        try:  # emptied before the queue is read: a receipt put after this writes a new byte
            os.read(self._wake_r, 1 << 12)
        except BlockingIOError:
            pass
        loaded = False
        while True:
            try:
                receipt = self._receipts.get_nowait()
            except queue.Empty:
                return loaded
            try:
                loaded |= self._finish(receipt)
            finally:
                if receipt.buffer is not None:
                    receipt.state = None  # the views go first: the buffer is written into again
                    self.buffers.give(receipt.buffer)

    def _finish(self, r: Receipt) -> bool:
        ann = r.announce
        if r.again:
            # The announce sent again after this session's hello (the broadcaster did not know
            # whether the first arrived): the first one's receipt came before this one, so the
            # version it brought is loaded (or not) by now; this session answers with it. Without
            # an answer the round waited out timeout_s (issue 42: a receive that ended just after
            # the hello was answered in the old session only, and the copy was skipped in silence).
            if r.session == self.session:
                self.peer.send(m.Heartbeat(policy_version=self.engine.policy_version))
            return False
        if r.error is not None:
            self.failures += 1
            current = r.session == self.session
            if isinstance(r.error, DigestMismatch):
                self.refused += 1
                e = r.error
                self.log.warning("weights_refused", version=ann.version, epoch=ann.group.epoch, bucket=e.bucket,
                                 expected=e.expected, got=e.got, digest_alg=ann.digest_alg, reported=current,
                                 error=str(e))
            else:
                self.log.warning("weights_not_received", version=ann.version, epoch=ann.group.epoch,
                                 reported=current, error=str(r.error))
            if current:  # the version it still holds, not the announced one: a failure
                self.peer.send(m.Heartbeat(policy_version=self.engine.policy_version))
            return False
        loaded = ann.version > self.engine.policy_version
        if loaded:
            t0 = time.monotonic()
            if ann.adapter is not None:  # a LoRA version (protocol 1.10): merged into the base
                self.engine.load_adapter(r.state, ann.adapter, ann.version)
            else:
                self.engine.load_weights(r.state, ann.version)
            self.loaded += 1
            self.log.info("weights_loaded", version=ann.version, epoch=ann.group.epoch, bytes=ann.num_bytes,
                          receive_s=round(r.seconds, 3), load_s=round(time.monotonic() - t0, 3))
        if r.session == self.session:
            # Only in the session of its announce, as a failure: an old round's version acked in
            # a new session reads as a refusal of the round the new session is in (issue 29: a
            # receive of epoch 1 that a network cut held for 26 s ended after the re-hello, and its
            # ack failed the generator's first round after the cut).
            self.peer.send(m.Heartbeat(policy_version=self.engine.policy_version))
        return loaded

    def close(self) -> None:
        """Say bye, stop the worker (after the round it is in, at most a moment) and leave the group."""
        self._jobs.put(None)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():  # a worker still in a collective may yet write to the pipe
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.group.close()
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()

    # ------------------------------------------------------------------ the worker thread

    def _next_job(self) -> tuple[m.WeightsAnnounce, int] | None:
        """The next announce to act on, with its session (None: stop); leaves the group on ``LEAVE``."""
        while (job := self._jobs.get()) is not None:
            if job == LEAVE:
                self.group.close()  # its store went with it: the next join connects to the new one
                self._last_tried = None  # a restarted broadcaster counts epochs from 1 again
                continue
            ann = job[0]
            try:
                nxt = self._jobs.queue[0]  # a peek: this thread is the queue's only consumer
            except IndexError:
                nxt = None
            if isinstance(nxt, tuple) and nxt[0].group.epoch > ann.group.epoch:
                self.log.info("announce_skipped", version=ann.version, epoch=ann.group.epoch,
                              newer_epoch=nxt[0].group.epoch)
                continue
            return job
        return None

    def _receive_loop(self) -> None:
        while (job := self._next_job()) is not None:
            ann, session = job
            # Rank 0 broadcasts each (epoch, version) once, in increasing order: an announce at or
            # below the last one tried is a copy sent again after a reconnect, and waiting on it
            # would block this thread for a whole timeout. A copy of the last one tried is answered
            # (``Receipt.again``); an older one is not: its answer could read as one to a later round.
            if self._last_tried is not None and (ann.group.epoch, ann.version) <= self._last_tried:
                if (ann.group.epoch, ann.version) == self._last_tried:
                    self._receipts.put(Receipt(ann, session, None, None, 0.0, again=True))
                    self._wake()
                continue
            self._last_tried = (ann.group.epoch, ann.version)
            t0 = time.monotonic()
            buffer = None
            try:
                if self.group.epoch != ann.group.epoch:
                    self.group.join(ann.group)
                buffer = self.buffers.take(ann.num_bytes, self.group.buffer_device())
                self.group.broadcast(buffer, ann.bucket_bytes, tag=ann.version)
                self._verify(ann, buffer)
                state = unflatten(ann.tensors, buffer)
            except Exception as e:  # GroupError, DigestMismatch, a layout that does not fit: reported
                self._receipts.put(Receipt(ann, session, None, e, time.monotonic() - t0, buffer))
            else:
                self._receipts.put(Receipt(ann, session, state, None, time.monotonic() - t0, buffer))
            self._wake()

    def _wake(self) -> None:
        """A receipt is waiting: wake the caller (``waitables``)."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the caller has wake-ups enough waiting
            pass

    def _verify(self, ann: m.WeightsAnnounce, buffer: torch.Tensor) -> None:
        """Raise ``DigestMismatch`` unless every received bucket has its announced digest under
        the announced ``digest_alg`` (``UnknownDigestAlg``, one, for an algorithm this process
        does not know: the bytes were received all the same, as the collective needs every rank).

        Runs on this worker thread, so decoding goes on meanwhile; it hashes on the host (per core
        about 1.4 GB/s with BLAKE2b, 7 GB/s with BLAKE3), and a buffer on the GPU (nccl) is first
        copied to the host one bucket at a time. It follows the whole receive rather than hashing
        each bucket while the next arrives: on the 2-core development machine that overlap made
        the fan-out slower by more than it saved (docs/benchmarks.md). Without digests (a 1.5
        broadcaster) nothing can be checked: said once per version."""
        if ann.digests or not ann.num_bytes:
            check_digests(buffer, ann.bucket_bytes, ann.digests, ann.digest_alg)
        elif self._unverified != ann.version:
            self._unverified = ann.version
            self.log.info("weights_unverified", version=ann.version, epoch=ann.group.epoch,
                          why="the announce carries no digests (a broadcaster older than protocol 1.6)")


class ServerWeightsLink(WeightsLink):
    """A server engine's session with the broadcaster (``engine.server_urls()``: the SGLang servers).

    ``hello`` names the servers' URLs; the broadcaster then updates their weights itself, through
    SGLang's distributed weight update, and this process receives nothing. A broadcaster heartbeat
    naming a version newer than the engine's makes the engine read its servers' versions at once
    (``refresh_versions``), so leases waiting for that version start without waiting for the next
    liveness probe; the broadcaster sends one as soon as a push to these servers succeeded. It is
    the generator's one source of versions (``weights.link``): the broker's copy is ignored. An
    adapter version (protocol 1.10) is told the same way once the servers loaded it as a LoRA
    adapter; the engine reads that from the servers too (``/v1/models``: ``april-v<N>``), so no
    field of the heartbeat says which kind a version is.
    """

    def __init__(self, name: str, endpoint: str, link: LinkConfig, engine, *, peer_factory=None):
        self.name, self.engine = name, engine
        self.log = get_logger(actor="generator", instance=name, component="weights")
        self.peer = (peer_factory or _broadcaster_peer(endpoint, name, link))(self._on_connect)

    def _on_connect(self, peer) -> None:
        peer.send(m.Hello(role="generator", instance=self.name, engine=self.engine.name,
                          policy_version=self.engine.policy_version, servers=self.engine.server_urls(),
                          incarnation=incarnation()))

    def waitables(self) -> list:
        """The broadcaster session's socket (``WeightSubscriber.waitables``)."""
        sock = getattr(self.peer, "sock", None)
        return [sock] if sock is not None else []

    def poll(self, timeout_s: float = 0.0) -> bool:
        msg = self.peer.poll(timeout_s)
        while msg is not None:
            body = msg.body
            if (isinstance(body, m.Heartbeat) and body.policy_version is not None
                    and body.policy_version > self.engine.policy_version):
                self.engine.refresh_versions()
            elif isinstance(body, m.Error):
                self.log.warning("broadcaster_error", code=body.code, message=body.message)
            msg = self.peer.poll(0.0)
        return False

    def close(self) -> None:
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
