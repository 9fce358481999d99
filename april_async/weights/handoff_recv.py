"""The broadcaster's side of the weight hand-off: the versions a learner sends, taken in, whole or
in parts. The sending half is ``weights.handoff`` (``WeightHandoff.send`` and ``send_parts``).

Parts (protocol 1.4). A version may come as ``parts`` messages, consecutive byte ranges of its
buffer. Part 0 (layout, ``total_bytes``) starts an assembly in a receive buffer, abandoning any
unfinished one; each later part is copied in at its offset; the last one hands the whole buffer
on exactly as a one-part update (``Whole``, with part 0's ``adapter``, protocol 1.10); each bucket
(``bucket_bytes``) is hashed for the announce's digests as soon as its last byte is in, while later
parts still arrive, so the digests are ready almost with the last part. A part that does not fit
the sequence (another version or part count, no part 0 before it, out of turn, a gap or an overlap,
bytes past ``total_bytes`` or a last part ending short of it, a layout in a later part) drops the
assembly and raises ``PartRefused`` naming the field, which the broadcaster answers with ``error``
``refused``, once per version: that version's later parts are dropped unanswered. A ``total_bytes`` over
``max_update_bytes`` is ``too_large``.

Receive buffers are reused between versions of one size: the receiver keeps one spare, which the
next assembly of that size takes unless a broadcast still reads it (``reading``). The broadcaster
hands buffers back as it lets go of them (``free``; ``free_after_hashing`` for one whose bytes
were copied to the GPU while its digests are still being hashed, then ``hashed``): on nccl the
one buffer is reused, on gloo two in turn (the held version's is read by the broadcast while the
next arrives).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from april_async.weights.flat import HASH_THREADS_MAX, digest
from april_async.wire import messages as m


@dataclass
class Whole:
    """A whole version in hand, however it came."""

    version: int
    tensors: list[m.TensorSpec]
    data: np.ndarray
    owned: bool = False
    """``data`` is a receive buffer of the receiver (assembled from parts), to be handed back."""
    prehashed: tuple[str, list[Future]] | None = None
    """``(digest_alg, one future per bucket)``: the digests of an assembly, hashed as its parts came."""
    adapter: m.AdapterSpec | None = None
    """Since 1.10: the version is this LoRA adapter's tensors (None: full weights)."""


@dataclass
class Assembly:
    """A version arriving in parts: where its bytes go, and what must come next."""

    sender: str
    version: int
    parts: int
    tensors: list[m.TensorSpec]
    data: np.ndarray  # total_bytes long; [0, filled) has arrived
    filled: int = 0
    next_part: int = 1
    digest_alg: str = m.BLAKE2B_128
    """What ``digests`` are hashed with: the broadcaster's choice for a round starting at part 0."""
    digests: list[Future] = field(default_factory=list)
    """The digests of the buckets already complete, being hashed while later parts arrive."""
    adapter: m.AdapterSpec | None = None
    """What part 0 said the version is (since 1.10): a LoRA adapter's tensors, or None: full weights."""


class PartRefused(Exception):
    """A ``weights_update`` part that does not fit the sequence: the error code and field to answer."""

    def __init__(self, field: str, why: str, code: str = "refused"):
        super().__init__(why)
        self.field, self.why, self.code = field, why, code


class PartsReceiver:
    """Takes each ``weights_update`` that carries bytes, assembles those in parts, and keeps the
    receive buffers for reuse (see the module docstring)."""

    def __init__(self, *, bucket_bytes: int, max_update_bytes: int, log,
                 reading: Callable[[], np.ndarray | None] = lambda: None):
        """``reading()``: the receive buffer a broadcast in progress reads (never written into)."""
        self.bucket_bytes, self.max_update_bytes = bucket_bytes, max_update_bytes
        self.log, self.reading = log, reading
        self.assembly: Assembly | None = None  # a version arriving in parts
        self.refused: tuple[str, int] | None = None  # (sender, version) whose later parts are dropped
        self.spare: np.ndarray | None = None  # a receive buffer free for the next assembly
        self.pending_spare: np.ndarray | None = None  # free once the held version's digests are in (nccl)
        self._hasher: ThreadPoolExecutor | None = None  # hashes an assembly's buckets as its parts arrive

    def take(self, sender: str, body: m.WeightsUpdate, digest_alg: Callable[[], str]) -> Whole | None:
        """The whole version once ``body`` completes one, else None (more parts are due, or this one
        was dropped). ``digest_alg()``: the hash a round starting now would announce, asked at part
        0 of an assembly. A part that does not fit raises ``PartRefused``, its version refused."""
        try:
            if body.part == 0:
                self.supersede(body.version)
                if body.parts == 1:  # the whole version in one message: no copy
                    if body.offset != 0:
                        raise PartRefused("offset", f"part 0 starts at offset {body.offset}, not 0")
                    if body.total_bytes not in (0, len(body.data)):
                        raise PartRefused("total_bytes", f"total_bytes {body.total_bytes} but the one part "
                                                         f"has {len(body.data)} bytes")
                    return Whole(body.version, body.tensors, body.data, adapter=body.adapter)
                self._start(sender, body, digest_alg)
                return None
            if self.refused == (sender, body.version):  # refused once: the rest goes unanswered
                self.log.debug("update_part_dropped", version=body.version, part=body.part, learner=sender)
                return None
            a = self._continue(sender, body)
            if a is None:
                return None
            self.assembly = None
            return Whole(a.version, a.tensors, a.data, owned=True, prehashed=(a.digest_alg, a.digests),
                         adapter=a.adapter)
        except PartRefused:
            if self.assembly is not None and self.assembly.sender == sender:
                self.drop("refused")
            self.refused = (sender, body.version)
            raise

    def supersede(self, version: int) -> None:
        """A new version starts (part 0, or a shared-memory region): any assembly is abandoned."""
        self.drop("superseded", by=version)
        self.refused = None

    def _start(self, sender: str, body: m.WeightsUpdate, digest_alg: Callable[[], str]) -> None:
        total = body.total_bytes or len(body.data)
        if body.offset != 0:
            raise PartRefused("offset", f"part 0 starts at offset {body.offset}, not 0")
        if total > self.max_update_bytes:
            raise PartRefused("total_bytes", f"total_bytes {total} is over the broadcaster's max_update_bytes "
                                             f"{self.max_update_bytes}", code="too_large")
        if len(body.data) > total:
            raise PartRefused("data", f"bytes [0, {len(body.data)}) run past total_bytes {total}")
        a = Assembly(sender, body.version, body.parts, list(body.tensors), self._buffer(total),
                     digest_alg=digest_alg(), adapter=body.adapter)
        a.data[: len(body.data)] = body.data
        a.filled = len(body.data)
        self.assembly = a
        self._hash_complete_buckets(a)

    def _hash_complete_buckets(self, a: Assembly) -> None:
        """Start hashing every bucket of ``a`` that has fully arrived (on a small thread pool), so
        that the digests are in hand almost as soon as the last part is: the hashing overlaps the
        receiving of the later parts instead of following it. They are hashed with the algorithm a
        round starting at part 0 would use; should the round need the other one, the broadcaster
        hashes them again."""
        bucket, total = self.bucket_bytes, len(a.data)
        while (start := len(a.digests) * bucket) < total and min(start + bucket, total) <= a.filled:
            if self._hasher is None:
                cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
                self._hasher = ThreadPoolExecutor(max(1, min(HASH_THREADS_MAX, cpus)),
                                                  thread_name_prefix="bcast-digest")
            a.digests.append(self._hasher.submit(digest, memoryview(a.data[start:min(start + bucket, total)]),
                                                 a.digest_alg))

    def _continue(self, sender: str, body: m.WeightsUpdate) -> Assembly | None:
        """Copy a later part in; the assembly when it is complete."""
        a = self.assembly
        if a is None or a.sender != sender:
            raise PartRefused("part", f"no part 0 of version {body.version} came before")
        if body.version != a.version:
            raise PartRefused("version", f"version {body.version} while version {a.version} is being assembled")
        if body.parts != a.parts:
            raise PartRefused("parts", f"parts {body.parts}, but part 0 of version {a.version} said {a.parts}")
        if body.part != a.next_part:
            raise PartRefused("part", f"part {body.part} out of turn: part {a.next_part} comes next")
        if body.tensors:
            raise PartRefused("tensors", "only part 0 carries the layout")
        if body.offset > a.filled:
            raise PartRefused("offset", f"offset {body.offset} leaves a gap: bytes [{a.filled}, {body.offset}) "
                                        f"never came")
        if body.offset < a.filled:
            raise PartRefused("offset", f"offset {body.offset} overlaps bytes [{body.offset}, {a.filled}) "
                                        f"that came before")
        end = body.offset + len(body.data)
        total = len(a.data)
        if end > total:
            raise PartRefused("data", f"bytes [{body.offset}, {end}) run past total_bytes {total}")
        if body.part == a.parts - 1 and end != total:
            raise PartRefused("data", f"the last part ends at byte {end}, short of total_bytes {total}")
        a.data[body.offset:end] = body.data
        a.filled, a.next_part = end, a.next_part + 1
        self._hash_complete_buckets(a)
        return a if body.part == a.parts - 1 else None

    def drop(self, reason: str, **fields) -> None:
        """Abandon the assembly in progress, if any; its buffer is free again."""
        a, self.assembly = self.assembly, None
        if a is None:
            return
        for job in a.digests:  # a hash already running ends, its result unused
            job.cancel()
        self.spare = a.data
        if reason != "refused":  # a refusal logs itself
            self.log.warning("assembly_abandoned", version=a.version, parts_received=a.next_part, parts=a.parts,
                             reason=reason, **fields)

    # ------------------------------------------------------------------ receive buffers

    def _buffer(self, num_bytes: int) -> np.ndarray:
        """A receive buffer: the spare one when it has this size and no broadcast reads it."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.nbytes == num_bytes:
            if self.reading() is not spare:
                return spare
            self.spare = spare  # still broadcast from: kept for later
        return np.empty(num_bytes, dtype=np.uint8)

    def unused(self, whole: Whole) -> None:
        """An assembled version the broadcaster did not keep (ignored or refused): its buffer is
        free again, and a hash still running on it is unused."""
        for job in whole.prehashed[1] if whole.prehashed else ():
            job.cancel()
        self.free(whole.data)

    def free(self, buffer: np.ndarray) -> None:
        """``buffer``, one of this receiver's, is no longer read: the next assembly may take it."""
        self.spare = buffer

    def free_after_hashing(self, buffer: np.ndarray) -> None:
        """``buffer`` is free once the digests hashed on it are in (``hashed``)."""
        self.pending_spare = buffer

    def hashed(self) -> None:
        """The held version's digests are in: nothing hashes a buffer any more."""
        if self.pending_spare is not None:
            self.spare, self.pending_spare = self.pending_spare, None

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)
