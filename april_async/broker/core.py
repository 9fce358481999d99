"""The broker's APRIL policy as a pure state machine: plain data, no I/O, no clock reads.

Every sample of every admitted group is in exactly one *place*::

    queued ──lease──► leased ──finish(stop|length)──► finished ──scored──► scored ──pull──► delivered
                        │  ▲                                                  (whole groups of n,
       abort / expiry   │  │ lease (recycled first)                             B groups a batch)
                        ▼  │
                      partial ◄──── restart (η broken: tokens dropped, counted)
    any held place ──── drop (η broken) / score error ────► retired (whole group, reason counted)

Time is an argument (``now``, seconds on the caller's clock). Methods that must make the outside
world do something (abort a lease) return ``AbortLease`` effects; the service sends them.
Reports are idempotent: a report on an unknown or ended lease, a chunk already applied, a score
for a sample not awaiting one, an old version — each is a counted no-op, so redelivery is safe.

A group that ends (delivered or retired) leaves the ledger at once, with its samples: the place
counts keep them (``place_counts`` is exact over the whole run), the counters keep their tokens, and
``samples``/``groups`` hold only what is still live. So memory, full garbage collections and the
snapshot stay the size of the work in flight, not of the run. A report about a sample that left
is a stale no-op like any other. Prompt ids are remembered while their group is open: the prompt
source yields each id once (``tasks/source.py``), so the ledger only guards its own replays.

``to_bytes``/``from_bytes`` snapshot the whole state as a typed ``Snapshot`` (MessagePack, one
named field per part of the state); the derived indexes are rebuilt on restore. Snapshots of the
earlier positional format 1 still load, through one conversion (``_snapshot_from_format_1``).
"""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Sequence
from itertools import islice
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import msgspec
import numpy as np

from april_async.broker.config import RolloutConfig
from april_async.broker.paged import PagedMap

SNAPSHOT_FORMAT = 2
"""What ``to_bytes`` writes. 1: positional lists (read only); 2: the ``Snapshot`` struct."""

TOKEN_TYPECODE = "i"
"""``array`` type of a sample's token ids (C int, 32 bits: any vocabulary)."""
LOGPROB_TYPECODE = "d"
"""``array`` type of a sample's log-probs (a C double holds a Python float exactly)."""
TOKEN_DTYPE = np.dtype(np.intc)  # the same as numpy types
LOGPROB_DTYPE = np.dtype(np.double)
_TOKEN_SIZE = TOKEN_DTYPE.itemsize

NO_TOKENS = b""
"""What a sample without tokens holds (queued, restarted, delivered): one shared immutable object.
The first chunk brings a ``bytearray`` of its own.

A sample's tokens and log-probs are ``bytearray``s of packed values (``TOKEN_DTYPE``,
``LOGPROB_DTYPE``), appended in place. Not lists (millions of int objects made 3 s full
collections at 1,000 generators), and not ``array.array``: since Python 3.11 an ``array`` is a
container the garbage collector tracks, and the hundred thousand of them a 1,000-generator ledger
holds, scattered over the heap, made every full collection 100 ms. A ``bytearray`` is not tracked,
and numpy reads it without a copy."""


def _token_bytes(values) -> bytes | memoryview:
    """Token ids (a list, an ``array('i')`` or a numpy array) packed as the ledger holds them;
    a value that is not an int or out of the 32-bit range is a ``TypeError``/``OverflowError``."""
    if isinstance(values, np.ndarray):
        if values.dtype == TOKEN_DTYPE:
            return values.tobytes()
        values = values.tolist()  # other widths: checked value by value below
    elif isinstance(values, array) and values.typecode == TOKEN_TYPECODE:
        return memoryview(values)
    out = array(TOKEN_TYPECODE)
    out.fromlist(values if type(values) is list else list(values))
    return memoryview(out)


def _logprob_bytes(values) -> bytes | memoryview:
    """Log-probs packed as the ledger holds them (float32 is widened exactly)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "f":
            return values.astype(LOGPROB_DTYPE, copy=False).tobytes()
        values = values.tolist()
    elif isinstance(values, array) and values.typecode == LOGPROB_TYPECODE:
        return memoryview(values)
    out = array(LOGPROB_TYPECODE)
    out.fromlist(values if type(values) is list else list(values))
    return memoryview(out)


def _token_view(buf) -> np.ndarray:
    """The ids in a packed buffer, as a numpy array that shares its memory (no copy)."""
    return np.frombuffer(buf, TOKEN_DTYPE)


def _logprob_view(buf) -> np.ndarray:
    return np.frombuffer(buf, LOGPROB_DTYPE)


class Place(enum.StrEnum):
    QUEUED = "queued"  # never leased
    LEASED = "leased"  # a generator works on it
    PARTIAL = "partial"  # waits to be resumed (aborted, reclaimed or restarted); keeps its tokens
    FINISHED = "finished"  # generation ended (stop/length); awaits its reward
    SCORED = "scored"  # rewarded; its group may not be complete yet
    DELIVERED = "delivered"  # handed to the learner in a batch
    RETIRED = "retired"  # its group was retired, with a counted reason


HELD_PLACES = (Place.PARTIAL, Place.FINISHED, Place.SCORED)

# The members as module names for the hot paths: in Python 3.11 ``Place.X`` runs a descriptor
# (60 ns, several per move), a global is a dict lookup.
_QUEUED, _LEASED, _PARTIAL, _FINISHED, _SCORED, _DELIVERED, _RETIRED = (
    Place.QUEUED, Place.LEASED, Place.PARTIAL, Place.FINISHED, Place.SCORED, Place.DELIVERED, Place.RETIRED)


class BrokerError(ValueError):
    """A request the broker refuses (the message names the offending value)."""


Spans = tuple[tuple[int, int], ...]
"""Run-length versions of a sample's tokens, ``((version, count), ...)``: tuples of ints, which the
garbage collector stops tracking at its first look (lists of lists it walks at every full
collection); a chunk replaces the tuple, a few pairs long, instead of editing it."""


# The ledger's records are msgspec Structs with ``gc=False``: never tracked by the cyclic garbage
# collector (they hold no reference cycles: ints, strings, enum members, arrays and tuples of
# ints), so a full collection does not visit the hundreds of thousands of live samples of a
# 1,000-generator cluster. As dataclasses, each sample was two tracked objects (itself and its
# ``__dict__``) plus its span lists, and full collections grew with the ledger.


class Sample(msgspec.Struct, gc=False):
    sample_id: int
    group_id: int
    index: int  # 0 .. n-1 within its group
    place: Place = Place.QUEUED
    token_bytes: bytearray | bytes = NO_TOKENS  # packed TOKEN_DTYPE (see NO_TOKENS)
    logprob_bytes: bytearray | bytes = NO_TOKENS  # packed LOGPROB_DTYPE
    spans: Spans = ()
    attempts: int = 0  # leases issued for it
    lease_id: int | None = None
    finish_reason: str | None = None
    reward: float | None = None
    finished_by: int | None = None  # the lease that finished it; scores must name it

    @property
    def oldest_version(self) -> int | None:
        return _oldest_of(self.spans) if self.spans else None

    @property
    def n_tokens(self) -> int:
        return len(self.token_bytes) // _TOKEN_SIZE

    @property
    def tokens(self) -> np.ndarray:
        """A copy of the token ids held (a view would pin the buffer: it could not grow)."""
        return _token_view(self.token_bytes).copy()

    @property
    def logprobs(self) -> np.ndarray:
        return _logprob_view(self.logprob_bytes).copy()


class Group(msgspec.Struct, gc=False):
    group_id: int
    prompt_id: str
    prompt: tuple[int, ...]  # a tuple of ints: the garbage collector stops tracking it, never walks it
    task: str
    meta: dict
    sample_ids: tuple[int, ...]
    admitted_at: float
    state: str = "open"  # open | delivering (chosen for the batch being packed) | delivered | retired
    retire_reason: str | None = None


class Lease(msgspec.Struct, gc=False):
    lease_id: int
    sample_id: int
    generator: str
    deadline: float
    aborting: bool = False


@dataclass(frozen=True)
class LeaseGrant:
    """What a generator needs to work on one sample (becomes a ``generate`` message).

    The tokens to resume from are a packed copy of the sample's buffer (``resume_bytes``), not a
    list: a lease call just after a step boundary resumes up to a generator's whole slot count of
    long partials, and a Python int per token made that call 88–100 ms at 1,000 generators. The
    service puts ``resume_tokens`` (a numpy view) on the wire as it is; ``resume`` is the list, for
    readers that want one.
    """

    lease_id: int
    sample_id: int
    group_id: int
    prompt: list[int]
    resume_bytes: bytes  # packed TOKEN_DTYPE, a copy (the sample's own buffer grows while leased)
    max_new_tokens: int
    min_policy_version: int

    @property
    def resume_tokens(self) -> np.ndarray:
        return _token_view(self.resume_bytes)

    @property
    def resume(self) -> list[int]:
        return _token_view(self.resume_bytes).tolist()

    @property
    def held(self) -> int:
        """How many tokens the sample already holds (the resume's length)."""
        return len(self.resume_bytes) // _TOKEN_SIZE


@dataclass(frozen=True)
class ScoreTask:
    """What a scorer needs to reward one sample (becomes a ``score_request``).

    ``lease_id`` names the lease that finished the sample: a score is applied only to that very
    response, so a redelivered score cannot land on a later response of a restarted sample.
    """

    sample_id: int
    lease_id: int
    group_id: int
    prompt: list[int]
    response: list[int]
    finish_reason: str
    task: str
    meta: dict


class AbortLease(msgspec.Struct, frozen=True, gc=False):
    """Effect: tell ``generator`` to stop ``lease_id`` and report what it has. A msgspec Struct:
    an early termination at 1,000 generators makes ~60,000 of them in one call (0.06 µs each
    against a frozen dataclass's 0.5)."""

    generator: str
    lease_id: int


class BatchSampleOut(msgspec.Struct, frozen=True, gc=False):
    """One delivered sample. The batch types are frozen msgspec Structs rather than frozen
    dataclasses: built 8× faster (0.06 µs against 0.5 µs; 64,000 a batch at 1,000 generators), and
    never tracked by the garbage collector (``gc=False``: they hold no reference cycles)."""

    sample_id: int
    reward: float
    finish_reason: str
    token_bytes: bytearray | bytes  # packed TOKEN_DTYPE: the sample's own buffer, handed over (it keeps none)
    logprob_bytes: bytearray | bytes  # packed LOGPROB_DTYPE, likewise
    spans: Spans

    @property
    def tokens(self) -> np.ndarray:
        """The token ids, a numpy view of the buffer (the batch's assembly joins the buffers
        themselves: a numpy array per sample cost 1 µs, 13 ms a batch of 6,400 samples)."""
        return _token_view(self.token_bytes)

    @property
    def logprobs(self) -> np.ndarray:
        return _logprob_view(self.logprob_bytes)


class BatchGroupOut(msgspec.Struct, frozen=True, gc=False):
    group_id: int
    prompt_id: str
    prompt: Sequence[int]
    task: str
    meta: dict
    samples: list[BatchSampleOut]


class BatchOut(msgspec.Struct, frozen=True, gc=False):
    batch_id: int
    policy_version: int
    groups: list[BatchGroupOut]


class Counters(msgspec.Struct, kw_only=True):
    """Everything a user will plot. Plain ints, or maps of ints keyed by a reason or a lag.

    Every map key is a string, a lag as its decimal digits (``"0"``, ``"1"``, ...): the counters
    travel in ``batch.stats``, and the protocol sends string keys only, so that any MessagePack
    decoder reads them with its defaults. A struct rather than a dataclass because it is also the
    snapshot's record of the counters: a counter added later loads as its default from an older
    snapshot.
    """

    groups_admitted: int = 0
    duplicate_prompts: int = 0
    prompts_refused: int = 0  # empty or over max_prompt_tokens
    leases_issued: int = 0
    leases_expired: int = 0  # leases reclaimed from silent or departed generators
    aborts_sent: int = 0
    early_terminations: int = 0
    partials_created: int = 0  # abort reports and reclaimed leases that kept their tokens
    partials_recycled: int = 0  # resumes of a sample that already had tokens
    tokens_resumed: int = 0  # tokens carried into those resumes (not regenerated)
    tokens_generated: int = 0  # tokens accepted from generators
    tokens_duplicate: int = 0  # tokens re-sent and ignored
    tokens_over_budget: int = 0  # tokens past max_response_tokens, ignored
    chunk_gaps: int = 0  # chunks that started beyond what the broker held, ignored
    stale_reports: int = 0  # reports on unknown or ended leases, ignored
    samples_finished: int = 0
    restarts: int = 0  # samples restarted for breaking η
    tokens_discarded: int = 0  # tokens dropped by those restarts
    groups_retired: dict[str, int] = {}  # reason -> groups
    tokens_retired: int = 0
    scores_ok: int = 0
    score_errors: int = 0
    score_timeouts: int = 0
    stale_scores: int = 0
    batches_delivered: int = 0
    groups_delivered: int = 0
    samples_delivered: int = 0
    tokens_delivered: int = 0
    off_policy_tokens: int = 0  # delivered tokens made by a version older than the learner's
    staleness_tokens: dict[str, int] = {}  # lag V - v ("0", "1", ...) -> delivered tokens
    staleness_samples: dict[str, int] = {}  # lag V - oldest -> delivered samples
    version_updates: int = 0
    groups_filtered: dict[str, int] = {}  # reason -> delivered groups the learner left out
    steps_skipped: int = 0  # batches the learner took no step on (every group filtered)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__struct_fields__}


def _bump(d: dict[str, int], key: str, by: int = 1) -> None:
    d[key] = d.get(key, 0) + by


def _count_down(d: dict[int, int], key: int) -> None:
    """One less under ``key``; none left: no entry (so that ``len(d)`` counts the keys in use)."""
    n = d[key] - 1
    if n:
        d[key] = n
    else:
        del d[key]


def _oldest_of(spans: Spans) -> int:
    """The oldest version in non-empty run-length ``spans``."""
    oldest = spans[0][0]
    for version, _ in spans:
        if version < oldest:
            oldest = version
    return oldest


class _Assembly:
    """A batch being packed a slice at a time: chosen, numbered and versioned at its first slice."""

    __slots__ = ("batch_id", "version", "group_ids", "packed", "groups")

    def __init__(self, batch_id: int, version: int, group_ids: list[int],
                 groups: list[BatchGroupOut] | None = None) -> None:
        self.batch_id, self.version, self.group_ids = batch_id, version, group_ids
        self.groups: list[BatchGroupOut] = [] if groups is None else groups  # packed so far, in order
        self.packed = len(self.groups)


class _DeliveryTally:
    """A batch's delivery counters, summed by version and turned into lags once per batch: per
    sample, only additions to small dicts of ints (string keys and lags per token span were most
    of ``pull_batch``'s own time)."""

    def __init__(self) -> None:
        self.samples = 0
        self.tokens = 0
        self.tokens_by_version: dict[int, int] = {}
        self.samples_by_oldest: dict[int, int] = {}

    def add(self, s: Sample) -> None:
        self.samples += 1
        self.tokens += s.n_tokens
        if not s.spans:
            return
        by_version = self.tokens_by_version
        oldest = None
        for version, count in s.spans:
            by_version[version] = by_version.get(version, 0) + count
            if oldest is None or version < oldest:
                oldest = version
        self.samples_by_oldest[oldest] = self.samples_by_oldest.get(oldest, 0) + 1

    def count_into(self, c: Counters, V: int) -> None:
        """Add the tally to ``c`` for a batch delivered at version ``V``."""
        c.samples_delivered += self.samples
        c.tokens_delivered += self.tokens
        for version, count in sorted(self.tokens_by_version.items(), reverse=True):
            lag = V - version
            _bump(c.staleness_tokens, str(lag), count)
            if lag > 0:
                c.off_policy_tokens += count
        for version, n in sorted(self.samples_by_oldest.items(), reverse=True):
            _bump(c.staleness_samples, str(V - version), n)


class FifoSet:
    """An ordered set of ints taken from the front: O(1) add, remove and first, and nothing for the
    garbage collector to walk.

    The ledger's queues hold up to hundreds of thousands of ids. A plain dict finds its first key by
    skipping every entry deleted before it (O(n) a lease once thousands went out); an
    ``OrderedDict`` follows a link, but it is a container the collector always tracks, and
    visiting its 256,000 ids made half of a 1,000-generator broker's full collections (75 ms).
    Here the order lives in an ``array`` (one object, whose contents the collector never visits)
    and membership in a dict of ints, which the collector stops tracking: each id is appended with
    a stamp, removal only forgets the id, and stale entries are skipped at the front and dropped
    when the array is compacted.
    """

    __slots__ = ("_order", "_members", "_head", "_next")
    _map: type = dict  # what holds the membership

    def __init__(self, ids: Sequence[int] = ()):
        self._order = array("q")  # id, stamp, id, stamp, ...
        self._members = self._map()  # id -> the stamp of its live entry
        self._head = 0  # index in _order of the first entry that may be live
        self._next = 0
        for i in ids:
            self[i] = None

    @classmethod
    def fromkeys(cls, ids: Sequence[int]) -> FifoSet:
        return cls(ids)

    def __setitem__(self, key: int, _value: None) -> None:
        """Add ``key`` at the back (already in: it stays where it is, like a dict's key)."""
        if key in self._members:
            return
        stamp = self._next
        self._next = stamp + 1
        self._members[key] = stamp
        self._order.append(key)
        self._order.append(stamp)

    def pop(self, key: int, default=None):
        return default if self._members.pop(key, _MISSING) is _MISSING else None

    def __delitem__(self, key: int) -> None:
        del self._members[key]

    def __contains__(self, key: int) -> bool:
        return key in self._members

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def _live_head(self) -> int:
        """Skip the dead entries at the front (each is skipped once) and return the index of the
        first live one (the end when none is)."""
        order, members, i, end = self._order, self._members, self._head, len(self._order)
        while i < end and members.get(order[i], -1) != order[i + 1]:  # a removed or re-added id's old entry
            i += 2
        if i > 4096 and i * 2 > end:  # drop the dead front: amortized O(1) per entry
            del order[:i]
            i = 0
        self._head = i
        return i

    def first(self) -> int:
        """The oldest id (the set must not be empty)."""
        return self._order[self._live_head()]

    def __iter__(self):
        """The ids, oldest first. Dead entries in the middle are skipped as met: a queue whose
        middle is taken (scoring, ready groups) should be read a few ids at a time (``islice``)."""
        order, members = self._order, self._members
        for i in range(self._live_head(), len(order), 2):
            key = order[i]
            if members.get(key, -1) == order[i + 1]:
                yield key


class PagedFifoSet(FifoSet):
    """A ``FifoSet`` whose membership is a ``PagedMap`` (also untracked by the collector), for the
    fresh queue: it holds a quarter of a million ids at 1,000 generators, and as a dict its table was
    rebuilt whole inside an ``admit`` whenever it grew (see ``paged.py``). The small queues keep a
    dict, whose operations are two to four times faster."""

    __slots__ = ()
    _map = PagedMap


_MISSING = object()


class BrokerCore:
    """The rollout ledger and the APRIL policy. See the module docstring."""

    def __init__(self, config: RolloutConfig):
        self.config = config
        self.version = 0  # the newest policy version published
        # Live samples (those of open groups), by id. The maps keyed by sample id that grow with the
        # ledger (this one, ``_moved_at``, ``_oldest`` and its buckets, the fresh queue) are
        # ``PagedMap``s: at 1,000 generators they hold 120,000-384,000 ids, and as dicts each
        # rebuilt its whole table when it grew or had churned through its spare room, 7-25 ms
        # apiece, up to three in the same ``admit``. A sample id is never inserted again once it
        # left and ids only grow, so ``samples`` iterates in the insertion order a dict would (the
        # snapshot's sample order).
        self.samples: PagedMap = PagedMap()  # sample id -> Sample
        self.groups: dict[int, Group] = {}  # open groups
        # Samples whose group ended and left the ledger, by their last place (delivered, retired).
        self.ended: dict[Place, int] = {Place.DELIVERED: 0, Place.RETIRED: 0}
        self.leases: dict[int, Lease] = {}
        self.scoring: dict[int, tuple[str, float]] = {}  # sample_id -> (scorer, deadline)
        self.counters = Counters()
        self.prompt_ids: dict[str, None] = {}  # of the open groups (a dict: not tracked by the collector)
        self.step_groups: set[int] = set()  # sync/april: groups leased in this rollout step
        self.awaiting_version: int | None = None  # sync/april: a batch went out at this version
        # Batches sent but not yet acknowledged by the learner, kept whole so that a batch lost
        # on the way (a broker crash right after ``pull_batch``) can be sent again.
        self.unacked_batches: dict[int, BatchOut] = {}
        self._assembly: _Assembly | None = None  # a batch being packed (``pull_batch`` in slices)
        self._next = {"group": 0, "sample": 0, "lease": 1, "batch": 0}
        self._rebuild_indexes()

    # ------------------------------------------------------------------ indexes (derived state)

    def _rebuild_indexes(self) -> None:
        # Ordered sets: the queue of each place, in arrival order. The queues taken from the
        # front are ``FifoSet``s (see there).
        self._fresh = PagedFifoSet()
        self._recycle = FifoSet()
        self._unscored = FifoSet()  # finished, not out for scoring
        self._done: dict[int, None] = {}  # open groups whose n samples are finished or scored
        self._ready = FifoSet()  # open groups whose n samples are scored
        # Live sample (not delivered or retired) -> when it last moved (a move counter): the live
        # samples in the order they last moved, which is the order the staleness bound visits them.
        # A rank, not an insertion-ordered dict re-inserted at every move: that dict filled with
        # deleted entries at every move and rebuilt all of itself every few hundred thousand moves
        # (20–60 ms in a lease or a finish, at 1,000 generators); this one changes keys only when a
        # sample is admitted or ends.
        self._moved_at = PagedMap()  # sample id -> move rank (its order is not used: sorted by rank)
        self._moves = 0
        # Live samples holding tokens, by the oldest version among them: a new version visits only
        # the samples it can make stale, not every live one (see ``publish_version``).
        self._oldest = PagedMap()  # sample -> the oldest version of its tokens
        # that version -> those samples (``PagedMap``s as sets: not tracked by the garbage
        # collector, where a set always is; paged, as one version's samples reach 120,000 at 1,000
        # generators)
        self._by_oldest: dict[int, PagedMap] = {}
        # Leases not yet told to abort, in lease order -> their generator. An early termination
        # tells every one of them at once: it empties this dict and raises ``_aborted_below`` (every
        # lease issued before it is aborting) instead of flagging each lease.
        self._unaborted: dict[int, str] = {}
        self._aborted_below = 0
        self._place_counts: dict[Place, int] = dict.fromkeys(Place, 0)
        self._place_counts.update(self.ended)
        # group -> its samples leased / finished or scored / scored (no entry: none)
        self._n_leased: dict[int, int] = {}
        self._n_done: dict[int, int] = {}
        self._n_scored: dict[int, int] = {}
        self._gen_leases: dict[str, dict[int, None]] = {}  # generator -> its leases
        self._scorers: set[str] = {scorer for scorer, _ in self.scoring.values()}  # names that took score requests
        for s in self.samples.values():
            self._index_add(s)
        for lease in self.leases.values():
            self._gen_leases.setdefault(lease.generator, {})[lease.lease_id] = None
            if not self._aborting(lease):
                self._unaborted[lease.lease_id] = lease.generator

    def _index_oldest(self, sid: int, version: int) -> None:
        """File live sample ``sid`` under ``version``, the oldest its tokens carry."""
        old = self._oldest.get(sid)
        if old == version:
            return
        if old is not None:
            self._unindex_oldest(sid)
        self._oldest[sid] = version
        bucket = self._by_oldest.get(version)
        if bucket is None:
            bucket = self._by_oldest[version] = PagedMap()
        bucket[sid] = None

    def _unindex_oldest(self, sid: int) -> None:
        old = self._oldest.pop(sid, None)
        if old is not None:
            bucket = self._by_oldest[old]
            bucket.pop(sid, None)
            if not bucket:
                del self._by_oldest[old]

    def _index_add(self, s: Sample) -> None:
        place, sid, gid = s.place, s.sample_id, s.group_id
        self._place_counts[place] += 1
        if place is _DELIVERED or place is _RETIRED:
            self._moved_at.pop(sid, None)
            self._unindex_oldest(sid)
            return
        self._moved_at[sid] = self._moves
        self._moves += 1
        if s.spans:
            self._index_oldest(sid, _oldest_of(s.spans))
        else:
            self._unindex_oldest(sid)
        if place is _QUEUED:
            self._fresh[sid] = None
        elif place is _PARTIAL:
            self._recycle[sid] = None
        elif place is _LEASED:
            self._n_leased[gid] = self._n_leased.get(gid, 0) + 1
        else:  # finished or scored
            if place is _FINISHED and sid not in self.scoring:
                self._unscored[sid] = None
            n = self._n_done[gid] = self._n_done.get(gid, 0) + 1
            if n == self.config.group_size:
                self._done[gid] = None
            if place is _SCORED:
                n = self._n_scored[gid] = self._n_scored.get(gid, 0) + 1
                if n == self.config.group_size:
                    self._ready[gid] = None

    def _index_remove(self, s: Sample) -> None:
        """Take ``s`` out of the indexes of its place (the oldest-version index is ``_index_add``'s:
        a move between two live places keeps it)."""
        place, sid, gid = s.place, s.sample_id, s.group_id
        self._place_counts[place] -= 1
        if place is _DELIVERED or place is _RETIRED:
            return
        if place is _QUEUED:
            self._fresh.pop(sid, None)
        elif place is _PARTIAL:
            self._recycle.pop(sid, None)
        elif place is _LEASED:
            _count_down(self._n_leased, gid)
        else:  # finished or scored
            if place is _FINISHED:
                self._unscored.pop(sid, None)
            _count_down(self._n_done, gid)
            self._done.pop(gid, None)
            if place is _SCORED:
                _count_down(self._n_scored, gid)
                self._ready.pop(gid, None)

    def _move(self, s: Sample, place: Place) -> None:
        """The one way a sample changes place: keeps every index in step."""
        self._index_remove(s)
        if s.place is _FINISHED:
            self.scoring.pop(s.sample_id, None)
        s.place = place
        self._index_add(s)

    # ------------------------------------------------------------------ views

    def place_counts(self) -> dict[str, int]:
        return {p.value: self._place_counts[p] for p in Place}

    def samples_in(self, place: Place) -> list[int]:
        """The ledger's samples in ``place`` (a place of ended groups holds none: they left)."""
        return [sid for sid, s in self.samples.items() if s.place is place]

    def audit(self) -> dict:
        """Conservation, checked: every admitted sample is in exactly one place, the live ones on
        the ledger, the ended ones counted; and every accepted token is held, delivered, discarded
        or retired."""
        counts = self.place_counts()
        live = sum(n for place, n in counts.items() if place not in (_DELIVERED, _RETIRED))
        expected = self.counters.groups_admitted * self.config.group_size
        c = self.counters
        held = sum(s.n_tokens for s in self.samples.values())
        tokens_ok = c.tokens_generated == held + c.tokens_delivered + c.tokens_discarded + c.tokens_retired
        return {"places": counts, "live": len(self.samples), "expected": expected,
                "balanced": live == len(self.samples) and sum(counts.values()) == expected and tokens_ok}

    def leased_groups(self) -> int:
        return len(self._n_leased)

    def leases_of(self, generator: str) -> list[int]:
        return sorted(self._gen_leases.get(generator, ()))

    def recycle_queue(self) -> list[int]:
        return list(self._recycle)

    def fresh_queue(self) -> list[int]:
        return list(self._fresh)

    def done_groups(self) -> list[int]:
        return list(self._done)

    def ready_groups(self) -> list[int]:
        return list(self._ready)

    def is_stale(self, s: Sample, version: int | None = None) -> bool:
        """True when ``s`` holds a token older than the staleness bound allows at ``version``."""
        oldest = s.oldest_version
        v = self.version if version is None else version
        return oldest is not None and v - oldest > self.config.staleness_bound

    # ------------------------------------------------------------------ admission

    def admit(self, prompt_id: str, prompt: Sequence[int], now: float, task: str = "", meta: dict | None = None) -> int | None:
        """Admit a prompt as a group of n queued samples. A prompt id seen before is a no-op (None)."""
        if prompt_id in self.prompt_ids:
            self.counters.duplicate_prompts += 1
            return None
        if not prompt:
            raise BrokerError(f"prompt {prompt_id!r} is empty")
        if len(prompt) > self.config.max_prompt_tokens:
            raise BrokerError(
                f"prompt {prompt_id!r} has {len(prompt)} tokens, over max_prompt_tokens={self.config.max_prompt_tokens}"
            )
        gid = self._take("group")
        ids = tuple(self._take("sample") for _ in range(self.config.group_size))
        self.groups[gid] = Group(gid, prompt_id, tuple(map(int, prompt)), task, dict(meta or {}), ids, now)
        self.prompt_ids[prompt_id] = None
        for k, sid in enumerate(ids):
            s = Sample(sid, gid, k)
            self.samples[sid] = s
            self._index_add(s)
        self.counters.groups_admitted += 1
        return gid

    def refuse_prompt(self, prompt_id: str) -> None:
        """Count a prompt the source gave that ``admit`` refused (so a restart skips it too)."""
        self.counters.prompts_refused += 1

    def _take(self, kind: str) -> int:
        value = self._next[kind]
        self._next[kind] = value + 1
        return value

    # ------------------------------------------------------------------ leasing

    def _leasing_open(self) -> bool:
        if self.config.mode == "async":
            return True
        return self.awaiting_version is None and len(self._done) < self.config.batch_groups

    def _group_admissible(self, gid: int) -> bool:
        cfg = self.config
        if gid in self._n_leased:
            return True
        if len(self._n_leased) >= cfg.max_inflight_groups:
            return False
        if cfg.mode == "async":
            return len(self._done) < cfg.async_max_ready_batches * cfg.batch_groups
        return gid in self.step_groups or len(self.step_groups) < cfg.max_inflight_groups

    def lease(self, generator: str, max_leases: int, now: float) -> list[LeaseGrant]:
        """Up to ``max_leases`` leases for ``generator``: recycled partials strictly first.

        While any partial waits, no fresh sample is leased: if the oldest partial may not start
        now (the in-flight bound), nothing is leased.
        """
        grants: list[LeaseGrant] = []
        while len(grants) < max_leases and self._leasing_open():
            queue = self._lease_queue()
            if not queue:
                break
            s = self.samples[queue.first()]
            if not self._group_admissible(s.group_id):
                break
            grants.append(self._grant(s, generator, now))
        return grants

    def _lease_queue(self) -> FifoSet:
        """Where the next lease comes from: recycled partials while any wait, else fresh samples."""
        return self._recycle or self._fresh

    def _grant(self, s: Sample, generator: str, now: float) -> LeaseGrant:
        lid = self._take("lease")
        self.leases[lid] = Lease(lid, s.sample_id, generator, now + self.config.lease_timeout_s)
        self._gen_leases.setdefault(generator, {})[lid] = None
        self._unaborted[lid] = generator
        held = s.n_tokens
        if held:
            self.counters.partials_recycled += 1
            self.counters.tokens_resumed += held
        s.attempts += 1
        s.lease_id = lid
        self._move(s, Place.LEASED)
        if self.config.mode != "async":
            self.step_groups.add(s.group_id)
        self.counters.leases_issued += 1
        g = self.groups[s.group_id]
        return LeaseGrant(
            lease_id=lid,
            sample_id=s.sample_id,
            group_id=s.group_id,
            prompt=list(g.prompt),
            resume_bytes=bytes(s.token_bytes),
            max_new_tokens=self.config.max_response_tokens - held,
            min_policy_version=self.version,
        )

    def _end_lease(self, lease: Lease) -> Sample:
        del self.leases[lease.lease_id]
        self._unaborted.pop(lease.lease_id, None)
        owned = self._gen_leases.get(lease.generator)
        if owned is not None:
            owned.pop(lease.lease_id, None)
            if not owned:
                del self._gen_leases[lease.generator]
        s = self.samples[lease.sample_id]
        s.lease_id = None
        return s

    # ------------------------------------------------------------------ generator reports

    def chunk(
        self,
        lease_id: int,
        offset: int,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        spans: Sequence[Sequence[int]],
        now: float,
    ) -> bool:
        """Apply a token chunk. Returns False when it was a no-op (unknown lease, duplicate, gap)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self.counters.stale_reports += 1
            return False
        return self._accept(self.samples[lease.sample_id], offset, tokens, logprobs, spans) is not None

    def _accept(self, s, offset, tokens, logprobs, spans) -> int | None:
        """Append the part of a chunk the broker does not hold yet; None on a gap."""
        covered = sum(count for _, count in spans)
        if not len(tokens) == len(logprobs) == covered:
            raise BrokerError(
                f"chunk for sample {s.sample_id}: {len(tokens)} tokens, {len(logprobs)} log-probs, spans cover {covered}"
            )
        held = s.n_tokens
        if offset > held:
            self.counters.chunk_gaps += 1
            return None
        skip = held - offset
        if skip >= len(tokens):
            self.counters.tokens_duplicate += len(tokens)
            return 0
        self.counters.tokens_duplicate += skip
        room = self.config.max_response_tokens - held
        take = min(len(tokens) - skip, room)
        self.counters.tokens_over_budget += len(tokens) - skip - take
        if take <= 0:
            return 0
        whole = skip == 0 and take == len(tokens)
        try:  # both converted before either is stored: a bad value changes nothing
            new_tokens = _token_bytes(tokens if whole else tokens[skip : skip + take])
            new_logprobs = _logprob_bytes(logprobs if whole else logprobs[skip : skip + take])
        except (TypeError, OverflowError, ValueError) as e:
            raise BrokerError(
                f"chunk for sample {s.sample_id}: a token id or log-prob is not a number: {e}") from None
        if held:
            s.token_bytes += new_tokens
            s.logprob_bytes += new_logprobs
        else:  # the first tokens: buffers of the sample's own
            s.token_bytes, s.logprob_bytes = bytearray(new_tokens), bytearray(new_logprobs)
        # Slice the run-length version spans to [skip, skip + take).
        pos, lo, hi = 0, skip, skip + take
        lowest = None
        held_spans = s.spans
        for version, count in spans:
            a, b = max(pos, lo), min(pos + count, hi)
            if a < b:
                version = int(version)
                if held_spans and held_spans[-1][0] == version:
                    held_spans = held_spans[:-1] + ((version, held_spans[-1][1] + b - a),)
                else:
                    held_spans = held_spans + ((version, b - a),)
                lowest = version if lowest is None else min(lowest, version)
            pos += count
        s.spans = held_spans
        old = self._oldest.get(s.sample_id)
        if s.sample_id in self._moved_at and (old is None or lowest < old):
            self._index_oldest(s.sample_id, lowest)
        self.counters.tokens_generated += take
        return take

    def finish(
        self,
        lease_id: int,
        offset: int,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        spans: Sequence[Sequence[int]],
        reason: str,
        now: float,
    ) -> list[AbortLease]:
        """The last chunk of a lease. ``stop``/``length``: finished; ``abort``: a partial;
        ``error``: the engine refused the sample for good, its group retires (``engine_refused``)."""
        if reason not in ("stop", "length", "abort", "error"):
            raise BrokerError(f"unknown finish reason {reason!r}")
        lease = self.leases.get(lease_id)
        if lease is None:
            self.counters.stale_reports += 1
            return []
        s = self.samples[lease.sample_id]
        if reason == "error":  # every engine would refuse it again: never lease it anew
            self._end_lease(lease)
            self._move(s, Place.PARTIAL)  # held by nobody until the group is retired just below
            return self.retire_group(s.group_id, "engine_refused")
        accepted = self._accept(s, offset, tokens, logprobs, spans)
        self._end_lease(lease)
        if s.n_tokens >= self.config.max_response_tokens:
            reason = "length"
        elif accepted is None:
            reason = "abort"  # the end of the response never reached us: resume from what we hold
        if reason == "abort":
            self._move(s, Place.PARTIAL)
            self.counters.partials_created += 1
            if s.attempts >= self.config.max_attempts:
                return self.retire_group(s.group_id, "attempts_exhausted")
        else:
            s.finish_reason, s.finished_by = reason, lease.lease_id
            self._move(s, Place.FINISHED)
            self.counters.samples_finished += 1
        effects = self._enforce_bound(s)
        return effects + self._maybe_terminate_early()

    def touch(self, peer: str, now: float) -> None:
        """Any message from ``peer`` is a heartbeat: push its lease and scoring deadlines out."""
        deadline = now + self.config.lease_timeout_s
        for lid in self._gen_leases.get(peer, ()):
            self.leases[lid].deadline = deadline
        if peer not in self._scorers:  # the common case: a generator's chunk
            return
        score_deadline = now + self.config.score_timeout_s
        for sid, (scorer, _) in self.scoring.items():
            if scorer == peer:
                self.scoring[sid] = (scorer, score_deadline)

    def expired(self, now: float) -> tuple[list[int], list[int]]:
        """The leases and score requests whose deadline has passed (a query: nothing changes).

        The service journals what it then does about them (``reclaim``, ``requeue_score``), so a
        replay does not depend on deadlines, which heartbeats move and the journal does not record.
        """
        leases = [lid for lid, lease in self.leases.items() if lease.deadline < now]
        scores = [sid for sid, (_, deadline) in self.scoring.items() if deadline < now]
        return leases, scores

    def expire(self, now: float) -> list[AbortLease]:
        """Reclaim leases and score requests whose deadline has passed (silent peers)."""
        leases, scores = self.expired(now)
        effects: list[AbortLease] = []
        for lid in leases:
            effects += self.reclaim(lid)
        for sid in scores:
            self.requeue_score(sid)
        return effects

    def reclaim(self, lease_id: int) -> list[AbortLease]:
        """End a lease whose generator is gone; its sample becomes a partial. Unknown: a no-op."""
        lease = self.leases.get(lease_id)
        return [] if lease is None else self._reclaim(lease)

    def requeue_score(self, sample_id: int) -> None:
        """Offer an unanswered score request to another scorer. Not out for scoring: a no-op."""
        if sample_id in self.scoring:
            self._return_to_scoring(sample_id)

    def peer_gone(self, peer: str, now: float) -> list[AbortLease]:
        """``peer`` said bye or was found dead: reclaim all its leases and score requests now."""
        effects: list[AbortLease] = []
        for lid in self.leases_of(peer):
            effects += self.reclaim(lid)
        for sid in [sid for sid, (scorer, _) in self.scoring.items() if scorer == peer]:
            self._return_to_scoring(sid)
        return effects

    def _reclaim(self, lease: Lease) -> list[AbortLease]:
        s = self._end_lease(lease)
        self.counters.leases_expired += 1
        self._move(s, Place.PARTIAL)
        if s.token_bytes:
            self.counters.partials_created += 1
        if s.attempts >= self.config.max_attempts:
            return self.retire_group(s.group_id, "attempts_exhausted")
        return self._enforce_bound(s)

    # ------------------------------------------------------------------ scoring

    def score_lease(self, scorer: str, max_tasks: int, now: float) -> list[ScoreTask]:
        """Up to ``max_tasks`` finished samples for ``scorer``, oldest first."""
        tasks = []
        for sid in list(islice(self._unscored, max_tasks)):
            s = self.samples[sid]
            g = self.groups[s.group_id]
            del self._unscored[sid]
            self.scoring[sid] = (scorer, now + self.config.score_timeout_s)
            self._scorers.add(scorer)
            tasks.append(ScoreTask(sid, s.finished_by, s.group_id, list(g.prompt), _token_view(s.token_bytes).tolist(),
                                   s.finish_reason, g.task, dict(g.meta)))
        return tasks

    def _return_to_scoring(self, sid: int) -> None:
        del self.scoring[sid]
        self._unscored[sid] = None
        self.counters.score_timeouts += 1

    def _awaiting_score(self, sample_id: int, lease_id: int) -> Sample | None:
        s = self.samples.get(sample_id)
        if s is None or s.place is not Place.FINISHED or s.finished_by != lease_id:
            self.counters.stale_scores += 1
            return None
        return s

    def scored(self, sample_id: int, lease_id: int, reward: float, now: float) -> list[AbortLease]:
        """Record a reward for the response that ``lease_id`` finished.

        A sample not awaiting that score (duplicate, retired, restarted since) is a no-op.
        """
        s = self._awaiting_score(sample_id, lease_id)
        if s is None:
            return []
        if not math.isfinite(reward):
            return self._fail_score(s, "score_error")
        s.reward = float(reward)
        self._move(s, Place.SCORED)
        self.counters.scores_ok += 1
        return []

    def score_failed(self, sample_id: int, lease_id: int, now: float, reason: str = "score_error") -> list[AbortLease]:
        """A reward function raised or timed out: the sample's whole group is retired, counted
        under ``reason`` (``reward_error``, ``reward_timeout``, ``bad_reward``, ...)."""
        s = self._awaiting_score(sample_id, lease_id)
        return [] if s is None else self._fail_score(s, reason)

    def _fail_score(self, s: Sample, reason: str) -> list[AbortLease]:
        self.counters.score_errors += 1
        return self.retire_group(s.group_id, reason)

    # ------------------------------------------------------------------ staleness and retirement

    def _enforce_bound(self, s: Sample) -> list[AbortLease]:
        """Apply the over-bound policy to a held sample that breaks η at the current version."""
        if s.place not in HELD_PLACES or not self.is_stale(s):
            return []
        if self.config.over_bound == "drop":
            return self.retire_group(s.group_id, "stale")
        self.counters.restarts += 1
        self.counters.tokens_discarded += s.n_tokens
        s.token_bytes, s.logprob_bytes, s.spans = NO_TOKENS, NO_TOKENS, ()
        s.finish_reason, s.reward, s.finished_by = None, None, None
        self._move(s, Place.PARTIAL)
        if s.attempts >= self.config.max_attempts:  # restarted, but out of leases
            return self.retire_group(s.group_id, "attempts_exhausted")
        return []

    def retire_group(self, group_id: int, reason: str) -> list[AbortLease]:
        """Retire a whole group (its leased samples are aborted); counted under ``reason``."""
        g = self.groups.get(group_id)
        if g is None or g.state != "open":
            return []
        effects = []
        for sid in g.sample_ids:
            s = self.samples[sid]
            if s.place is Place.LEASED:
                lease = self.leases[s.lease_id]
                if not self._aborting(lease):  # one abort per lease is enough
                    effects.append(AbortLease(lease.generator, lease.lease_id))
                self._end_lease(lease)
            self.counters.tokens_retired += s.n_tokens
            self._move(s, Place.RETIRED)
        g.state, g.retire_reason = "retired", reason
        self._forget(g)
        _bump(self.counters.groups_retired, reason)
        self.counters.aborts_sent += len(effects)
        return effects

    def _maybe_terminate_early(self) -> list[AbortLease]:
        """``april``: once B groups are complete, abort everything still in flight (unless the
        boundary is ``continue``: then it goes on decoding, see ``RolloutConfig.boundary``)."""
        if self.config.mode != "april" or self.config.boundary == "continue" or len(self._done) < self.config.batch_groups:
            return []
        unaborted = self._unaborted
        if not unaborted:
            return []
        # One effect per lease, but no per-lease bookkeeping: every lease issued so far is now
        # aborting (60,000 leases at 1,000 generators: a flag each made this call 50–63 ms).
        effects = [AbortLease(generator, lid) for lid, generator in unaborted.items()]
        self._unaborted = {}
        self._aborted_below = self._next["lease"]
        self.counters.early_terminations += 1
        self.counters.aborts_sent += len(effects)
        return effects

    # ------------------------------------------------------------------ versions and batches

    def publish_version(self, version: int, now: float) -> list[AbortLease]:
        """Policy ``version`` is out. Older or equal versions are no-ops.

        Held samples that now break η get the over-bound policy; leases whose tokens already
        break it are aborted (they come back as partials and get the policy then). In sync/april
        a version newer than the last batch's opens the next rollout step.
        """
        if version <= self.version:
            return []
        self.version = version
        self.counters.version_updates += 1
        if self.awaiting_version is not None and version > self.awaiting_version:
            self.awaiting_version = None
            self._open_next_step()
        effects: list[AbortLease] = []
        for sid in self._stale_candidates():
            s = self.samples.get(sid)
            if s is None:  # its group was retired by the bound, for a sample before it ("drop")
                continue
            if s.place in HELD_PLACES:
                if self.groups[s.group_id].state == "open":  # else being delivered, in bound at its batch's version
                    effects += self._enforce_bound(s)
            elif s.place is Place.LEASED and self.is_stale(s):
                lease = self.leases[s.lease_id]
                if not self._aborting(lease):
                    self._set_aborting(lease)
                    self.counters.aborts_sent += 1
                    effects.append(AbortLease(lease.generator, lease.lease_id))
        return effects

    def _open_next_step(self) -> None:
        """sync/april: the next rollout step starts with the groups still leased. Updated in place:
        a new set of thousands of groups took 0.5–9 ms to allocate in the simulator (fresh memory
        from the OS), the in-place update tens of µs."""
        groups, leased = self.step_groups, self._n_leased
        groups.difference_update([gid for gid in groups if gid not in leased])
        groups.update(leased)

    def _stale_candidates(self) -> list[int]:
        """The live samples whose oldest token is over η at the current version, in the order
        they last moved (the order the bound is applied in decides the order of the partials it
        makes, so it is the order of every live sample, as a full scan would visit them).

        Only the versions that η now excludes are looked at: a version visits the samples it
        can make stale, not every live one (a scan of all live samples cost 30–240 ms a version
        at 1,000 generators).
        """
        limit = self.version - self.config.staleness_bound  # a sample from a version below this is stale
        found: list[int] = []
        for version, sids in self._by_oldest.items():
            if version < limit:
                found.extend(sids)
        found.sort(key=self._moved_at.__getitem__)
        return found

    def _set_aborting(self, lease: Lease) -> None:
        lease.aborting = True
        self._unaborted.pop(lease.lease_id, None)

    def _aborting(self, lease: Lease) -> bool:
        """Whether ``lease`` was told to abort: flagged alone, or by an early termination."""
        return lease.aborting or lease.lease_id < self._aborted_below

    def batch_pending(self) -> bool:
        """Whether ``pull_batch`` has work: a batch being packed, or B groups ready to start one."""
        return self._assembly is not None or len(self._ready) >= self.config.batch_groups

    def pull_batch(self, now: float, max_samples: int | None = None) -> BatchOut | None:
        """B whole, scored, in-bound groups for the learner, oldest first; None until there are B.

        ``max_samples`` packs the batch a slice at a time: each call moves whole groups, at least
        one and about ``max_samples`` samples, and the call that packs the last group returns the
        batch (None before). A batch of 64,000 samples, three µs each to leave the ledger, held a
        1,000-generator broker for 200 ms in one call; in slices, every message that arrives in
        between is handled in between. The batch is chosen, and its version fixed, at the first
        call: its groups are out of the ready queue, a new version cannot make them stale (they are
        in bound at the batch's version), and in sync/april the next rollout step waits for a
        version newer than the batch's, as for a whole one. ``None``: the whole batch in one call.
        """
        a = self._assembly
        if a is None:
            B = self.config.batch_groups
            if len(self._ready) < B:
                return None
            chosen = list(islice(self._ready, B))
            for gid in chosen:
                self._ready.pop(gid)
                self._done.pop(gid, None)
                self.groups[gid].state = "delivering"
            a = self._assembly = _Assembly(self._take("batch"), self.version, chosen)
            if self.config.mode != "async":
                self.awaiting_version = a.version
        budget = math.inf if max_samples is None else max(1, max_samples)
        tally = _DeliveryTally()
        V, out_groups, chosen = a.version, a.groups, a.group_ids
        n = self.config.group_size
        while a.packed < len(chosen) and budget > 0:
            gid = chosen[a.packed]
            a.packed += 1
            budget -= n
            g = self.groups[gid]
            samples = [self.samples[sid] for sid in g.sample_ids]
            out_groups.append(
                BatchGroupOut(
                    gid,
                    g.prompt_id,
                    g.prompt,  # a tuple: shared, not copied
                    g.task,
                    dict(g.meta),
                    # The token arrays leave with the batch (the sample gets empty ones below); the
                    # spans are shared: a delivered sample's never change again.
                    [BatchSampleOut(s.sample_id, s.reward, s.finish_reason, s.token_bytes, s.logprob_bytes,
                                    s.spans)
                     for s in samples],
                )
            )
            for s in samples:
                tally.add(s)
                self._move(s, Place.DELIVERED)
                s.token_bytes, s.logprob_bytes = NO_TOKENS, NO_TOKENS
            g.state = "delivered"
            self._forget(g)
        tally.count_into(self.counters, V)  # per slice: the audit balances between slices too
        if a.packed < len(chosen):
            return None
        self._assembly = None
        c = self.counters
        c.batches_delivered += 1
        c.groups_delivered += len(chosen)
        batch = BatchOut(a.batch_id, V, out_groups)
        self.unacked_batches[batch.batch_id] = batch
        return batch

    def _forget(self, g: Group) -> None:
        """Group ``g`` ended: it and its samples leave the ledger; ``ended`` counts them."""
        for sid in g.sample_ids:
            s = self.samples.pop(sid)
            self.ended[s.place] += 1
        del self.groups[g.group_id]
        self.prompt_ids.pop(g.prompt_id, None)
        self.step_groups.discard(g.group_id)

    def report_batch(self, batch_id: int, policy_version: int, dropped_groups: Sequence[int], reason: str) -> None:
        """The learner is done with ``batch_id``: count the groups it left out under ``reason``.

        A report whose ``policy_version`` is not newer than the batch's means no step was taken
        (every group was filtered). In sync/april the next rollout step waits for a newer version,
        which will not come for this batch, so the step is reopened here.
        """
        if batch_id >= self._next["batch"]:
            self.counters.stale_reports += 1
            return
        if dropped_groups:
            _bump(self.counters.groups_filtered, reason or "unspecified", len(dropped_groups))
        newest = batch_id == self._next["batch"] - 1  # an older batch's report (redelivered) reopens nothing
        if newest and self.awaiting_version is not None and policy_version <= self.awaiting_version:
            self.counters.steps_skipped += 1
            self.awaiting_version = None
            self._open_next_step()

    def ack_batches(self, upto_batch_id: int) -> bool:
        """The learner holds every batch up to ``upto_batch_id``: forget them. True if any was."""
        done = [bid for bid in self.unacked_batches if bid <= upto_batch_id]
        for bid in done:
            del self.unacked_batches[bid]
        return bool(done)

    def unacked_batch_after(self, batch_id: int | None) -> BatchOut | None:
        """The oldest sent batch the learner has not acknowledged (``batch_id``: its newest)."""
        for bid, batch in self.unacked_batches.items():
            if batch_id is None or bid > batch_id:
                return batch
        return None


    # ------------------------------------------------------------------ snapshot

    def to_bytes(self) -> bytes:
        """The whole state as a MessagePack ``Snapshot`` (queue order included; indexes are not)."""
        snap = Snapshot(
            format=SNAPSHOT_FORMAT,
            config=self.config.model_dump(mode="json"),
            version=self.version,
            next_ids=NextIds(**self._next),
            counters=self.counters,
            prompt_ids=sorted(self.prompt_ids),
            step_groups=sorted(self.step_groups),
            awaiting_version=self.awaiting_version,
            groups=[GroupRecord(group_id=g.group_id, prompt_id=g.prompt_id, prompt=g.prompt, task=g.task,
                                meta=g.meta, sample_ids=g.sample_ids, admitted_at=g.admitted_at,
                                state=g.state, retire_reason=g.retire_reason) for g in self.groups.values()],
            samples=[SampleRecord(sample_id=s.sample_id, group_id=s.group_id, index=s.index, place=s.place,
                                  tokens=_token_view(s.token_bytes).tolist(),
                                  logprobs=_logprob_view(s.logprob_bytes).tolist(), spans=s.spans,
                                  attempts=s.attempts,
                                  lease_id=s.lease_id, finish_reason=s.finish_reason, reward=s.reward,
                                  finished_by=s.finished_by) for s in self.samples.values()],
            leases=[LeaseRecord(lease_id=x.lease_id, sample_id=x.sample_id, generator=x.generator,
                                deadline=x.deadline, aborting=self._aborting(x)) for x in self.leases.values()],
            scoring=[ScoringRecord(sample_id=sid, scorer=scorer, deadline=deadline)
                     for sid, (scorer, deadline) in self.scoring.items()],
            unacked_batches=[_batch_record(b) for b in self.unacked_batches.values()],
            assembly=None if self._assembly is None else AssemblyRecord(
                batch_id=self._assembly.batch_id, policy_version=self._assembly.version,
                group_ids=list(self._assembly.group_ids), packed=_group_records(self._assembly.groups)),
            ended={place.value: n for place, n in self.ended.items()},
            queues=Queues(fresh=list(self._fresh), recycle=list(self._recycle), unscored=list(self._unscored),
                          done=list(self._done), ready=list(self._ready), live=sorted(self._moved_at, key=self._moved_at.__getitem__)),
        )
        return _SNAPSHOT_ENCODER.encode(snap)

    @classmethod
    def from_bytes(cls, data: bytes, config: RolloutConfig | None = None) -> BrokerCore:
        """Rebuild a core from a snapshot of any format ``read_snapshot`` reads.

        ``config`` overrides the stored one (same shape only). Anything that cannot be restored is a
        ``BrokerError`` naming the problem.
        """
        snap = read_snapshot(data)
        try:
            stored = RolloutConfig.model_validate(snap.config)
        except ValueError as e:
            raise BrokerError(f"snapshot holds an invalid config: {e}") from None
        if config is not None and config.group_size != stored.group_size:
            raise BrokerError(f"snapshot has group_size={stored.group_size}, config says {config.group_size}")
        core = cls(config or stored)
        core.version = snap.version
        core._next = msgspec.structs.asdict(snap.next_ids)
        core.counters = snap.counters
        core.step_groups = set(snap.step_groups)
        core.awaiting_version = snap.awaiting_version
        for g in snap.groups:
            core.groups[g.group_id] = Group(g.group_id, g.prompt_id, tuple(g.prompt), g.task, g.meta,
                                            tuple(g.sample_ids),
                                            g.admitted_at, g.state, g.retire_reason)
        for s in snap.samples:
            try:
                tokens = bytearray(_token_bytes(s.tokens)) if s.tokens else NO_TOKENS
                logprobs = bytearray(_logprob_bytes(s.logprobs)) if s.logprobs else NO_TOKENS
            except OverflowError as e:
                raise BrokerError(f"snapshot is inconsistent: sample {s.sample_id} holds {e}") from None
            core.samples[s.sample_id] = Sample(s.sample_id, s.group_id, s.index, s.place, tokens, logprobs,
                                               _spans(s.spans), s.attempts, s.lease_id, s.finish_reason, s.reward,
                                               s.finished_by)
        for place, n in snap.ended.items():
            core.ended[Place(place)] += n
        # A snapshot written before groups left the ledger on ending holds them: they leave now.
        for g in [g for g in core.groups.values() if g.state in ("delivered", "retired")]:
            for sid in g.sample_ids:
                s = core.samples.get(sid)
                if s is None or s.place not in (Place.DELIVERED, Place.RETIRED):
                    raise BrokerError(f"snapshot is inconsistent: sample {sid} of {g.state} group {g.group_id}"
                                      f" is {'missing' if s is None else s.place.value}")
            core._forget(g)
        core.prompt_ids = dict.fromkeys(g.prompt_id for g in core.groups.values())
        for x in snap.leases:
            core.leases[x.lease_id] = Lease(x.lease_id, x.sample_id, x.generator, x.deadline, x.aborting)
        for r in snap.scoring:
            core.scoring[r.sample_id] = (r.scorer, r.deadline)
        for b in snap.unacked_batches:
            core.unacked_batches[b.batch_id] = BatchOut(b.batch_id, b.policy_version, _batch_groups(b.groups))
        delivering = [g.group_id for g in core.groups.values() if g.state == "delivering"]
        if snap.assembly is not None:
            a = snap.assembly
            pending = a.group_ids[len(a.packed):]
            if sorted(pending) != sorted(delivering) or [g.group_id for g in a.packed] != a.group_ids[:len(a.packed)]:
                raise BrokerError(f"snapshot is inconsistent: batch {a.batch_id} being packed lists groups "
                                  f"{a.group_ids}, the ledger has {sorted(delivering)} still to pack")
            core._assembly = _Assembly(a.batch_id, a.policy_version, list(a.group_ids), _batch_groups(a.packed))
        elif delivering:
            raise BrokerError(f"snapshot is inconsistent: groups {delivering} are being delivered in no batch")
        missing = sorted(({x.sample_id for x in snap.leases} | set(core.scoring)) - set(core.samples))
        if missing:
            raise BrokerError(
                f"snapshot is inconsistent: leases or score requests name unknown samples {missing}")
        core._rebuild_indexes()
        for gid in delivering:  # chosen for the batch being packed: out of the queues already
            core._done.pop(gid, None)
            core._ready.pop(gid, None)
        # Queue order is part of the policy (FIFO fairness): the indexes rebuilt from the samples
        # must hold what the snapshot lists, in the snapshot's order.
        for name in Queues.__struct_fields__:
            ids = getattr(snap.queues, name)
            if name == "live":
                if set(core._moved_at) != set(ids):
                    raise BrokerError("snapshot is inconsistent: the live samples are not the samples' places")
                core._moved_at = PagedMap.of((sid, rank) for rank, sid in enumerate(ids))
                core._moves = len(ids)
                continue
            attr = "_" + name
            queue = getattr(core, attr)
            if set(queue) != set(ids):
                raise BrokerError(f"snapshot is inconsistent: queue {name!r} does not match the samples' places")
            setattr(core, attr, type(queue).fromkeys(ids))
        return core

    def rebase_deadlines(self, now: float) -> None:
        """After a restart the old clock's deadlines mean nothing: give every peer a full timeout."""
        for lease in self.leases.values():
            lease.deadline = now + self.config.lease_timeout_s
        for sid, (scorer, _) in self.scoring.items():
            self.scoring[sid] = (scorer, now + self.config.score_timeout_s)


# ---------------------------------------------------------------------------------------------
# The snapshot: one struct per part of the state, every field named. A field added later gets a
# default, so that older snapshots of the same format still load; anything else is a new format.


class NextIds(msgspec.Struct, kw_only=True):
    """The next id each kind of thing gets."""

    group: int
    sample: int
    lease: int
    batch: int


class GroupRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One admitted prompt and its ``n`` samples."""

    group_id: int
    prompt_id: str
    prompt: list[int]
    task: str = ""
    meta: dict[str, Any] = {}
    sample_ids: list[int]
    admitted_at: float
    state: Literal["open", "delivering", "delivered", "retired"] = "open"
    retire_reason: str | None = None


class SampleRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sample: its place, what it holds, and the lease that has it or finished it."""

    sample_id: int
    group_id: int
    index: int  # 0 .. n-1 within its group
    place: Place
    tokens: list[int] = []
    logprobs: list[float] = []
    spans: list[list[int]] = []  # [[version, count], ...]
    attempts: int = 0
    lease_id: int | None = None
    finish_reason: str | None = None
    reward: float | None = None
    finished_by: int | None = None


class LeaseRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One lease a generator holds."""

    lease_id: int
    sample_id: int
    generator: str
    deadline: float  # on the old process's clock; a restart rebases it
    aborting: bool = False


class ScoringRecord(msgspec.Struct, kw_only=True):
    """One score request out at a scorer."""

    sample_id: int
    scorer: str
    deadline: float


class BatchSampleRecord(msgspec.Struct, kw_only=True):
    sample_id: int
    reward: float
    finish_reason: str
    tokens: list[int]
    logprobs: list[float]
    spans: list[list[int]]


class BatchGroupRecord(msgspec.Struct, kw_only=True):
    group_id: int
    prompt_id: str
    prompt: list[int]
    task: str
    meta: dict[str, Any]
    samples: list[BatchSampleRecord]


class BatchRecord(msgspec.Struct, kw_only=True):
    """A batch sent to the learner and not yet acknowledged, kept whole to be sent again."""

    batch_id: int
    policy_version: int
    groups: list[BatchGroupRecord]


class AssemblyRecord(msgspec.Struct, kw_only=True):
    """A batch being packed a slice at a time (``pull_batch(now, max_samples)``): its groups in
    order, the packed ones whole; the rest are still on the ledger, in state ``delivering``."""

    batch_id: int
    policy_version: int
    group_ids: list[int]
    packed: list[BatchGroupRecord]


class Queues(msgspec.Struct, kw_only=True):
    """The order of each queue (the samples' places say what is in it; the snapshot says in what order)."""

    fresh: list[int]  # queued samples
    recycle: list[int]  # partials waiting to be resumed
    unscored: list[int]  # finished samples not out for scoring
    done: list[int]  # open groups whose n samples are finished or scored
    ready: list[int]  # open groups whose n samples are scored
    # Samples not delivered or retired, in the order they last moved: a new version applies the
    # staleness bound to them in this order, which decides the order of the partials it makes.
    live: list[int]


class Snapshot(msgspec.Struct, kw_only=True):
    """The whole state of a ``BrokerCore``; ``format`` comes first so that it can be read alone."""

    format: int
    config: dict[str, Any]  # the RolloutConfig it ran with (checked by pydantic on restore)
    version: int
    next_ids: NextIds
    counters: Counters
    prompt_ids: list[str]
    step_groups: list[int]  # sync/april: the groups of the current rollout step
    awaiting_version: int | None
    groups: list[GroupRecord]
    samples: list[SampleRecord]
    leases: list[LeaseRecord]
    scoring: list[ScoringRecord]
    unacked_batches: list[BatchRecord]
    queues: Queues
    # Samples of ended groups, no longer on the ledger, by their last place ("delivered", "retired").
    # Absent in snapshots written while ended groups stayed on it (they are counted on restore).
    ended: dict[Literal["delivered", "retired"], int] = {}
    assembly: AssemblyRecord | None = None  # absent before batches were packed in slices


class _FormatProbe(msgspec.Struct):
    format: int | None = None


_SNAPSHOT_ENCODER = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(Snapshot)
_FORMAT_DECODER = msgspec.msgpack.Decoder(_FormatProbe)


def read_snapshot(data: bytes) -> Snapshot:
    """The ``Snapshot`` in ``data``, whatever format wrote it; a ``BrokerError`` naming the problem
    when it is not a snapshot, is damaged, or has a format this code does not read."""
    try:
        fmt = _FORMAT_DECODER.decode(data).format
    except msgspec.DecodeError as e:
        raise BrokerError(f"snapshot is not readable: {e}") from None
    if fmt == SNAPSHOT_FORMAT:
        try:
            return _SNAPSHOT_DECODER.decode(data)
        except msgspec.DecodeError as e:
            raise BrokerError(f"snapshot (format {fmt}) is malformed: {e}") from None
    if fmt == 1:
        return _snapshot_from_format_1(data)
    raise BrokerError(f"snapshot format {fmt!r} is not one this broker reads (1 or {SNAPSHOT_FORMAT})")


# Format 1 stored each record as a list, in these field orders.
_V1_GROUP = ("group_id", "prompt_id", "prompt", "task", "meta", "sample_ids", "admitted_at", "state",
             "retire_reason")
_V1_SAMPLE = ("sample_id", "group_id", "index", "place", "tokens", "logprobs", "spans", "attempts",
              "lease_id", "finish_reason", "reward", "finished_by")
_V1_LEASE = ("lease_id", "sample_id", "generator", "deadline", "aborting")
_V1_SCORING = ("sample_id", "scorer", "deadline")
_V1_BATCH_GROUP = ("group_id", "prompt_id", "prompt", "task", "meta", "samples")
_V1_BATCH_SAMPLE = ("sample_id", "reward", "finish_reason", "tokens", "logprobs", "spans")


def _snapshot_from_format_1(data: bytes) -> Snapshot:
    """The one conversion from format 1: positional lists become named records, and the lag keys
    of the staleness counters (integers in format 1) become decimal strings."""

    def named(keys: tuple[str, ...], row: list) -> dict:
        if len(row) != len(keys):
            raise ValueError(f"a record of {len(row)} values where {len(keys)} ({', '.join(keys)}) belong")
        return dict(zip(keys, row, strict=True))

    def batch(row: list) -> dict:
        batch_id, policy_version, groups = row
        return {"batch_id": batch_id, "policy_version": policy_version, "groups": [
            {**named(_V1_BATCH_GROUP, g), "samples": [named(_V1_BATCH_SAMPLE, x) for x in g[5]]}
            for g in groups]}

    try:
        old = msgpack.unpackb(data, raw=False, strict_map_key=False)
        counters = dict(old["counters"])
        for name in ("staleness_tokens", "staleness_samples"):
            counters[name] = {str(lag): n for lag, n in counters.get(name, {}).items()}
        plain = {
            "format": SNAPSHOT_FORMAT,
            "config": old["config"],
            "version": old["version"],
            "next_ids": old["next"],
            "counters": counters,
            "prompt_ids": old["prompt_ids"],
            "step_groups": old["step_groups"],
            "awaiting_version": old["awaiting_version"],
            "groups": [named(_V1_GROUP, row) for row in old["groups"]],
            "samples": [named(_V1_SAMPLE, row) for row in old["samples"]],
            "leases": [named(_V1_LEASE, row) for row in old["leases"]],
            "scoring": [named(_V1_SCORING, row) for row in old["scoring"]],
            "unacked_batches": [batch(row) for row in old["unacked_batches"]],
            # Format 1 did not keep the order of live samples; restoring it gave them in sample order.
            "queues": {**old["order"], "live": [row[0] for row in old["samples"]
                                                if row[3] not in (Place.DELIVERED, Place.RETIRED)]},
        }
        return msgspec.convert(plain, Snapshot)
    except KeyError as e:
        raise BrokerError(f"snapshot (format 1) is malformed: no {e.args[0]!r}") from None
    except (msgspec.ValidationError, ValueError, TypeError, AttributeError) as e:
        raise BrokerError(f"snapshot (format 1) is malformed: {e}") from None


def _batch_record(b: BatchOut) -> BatchRecord:
    return BatchRecord(batch_id=b.batch_id, policy_version=b.policy_version, groups=_group_records(b.groups))


def _group_records(groups: Sequence[BatchGroupOut]) -> list[BatchGroupRecord]:
    return [BatchGroupRecord(group_id=g.group_id, prompt_id=g.prompt_id, prompt=g.prompt, task=g.task,
                             meta=g.meta, samples=[BatchSampleRecord(sample_id=x.sample_id, reward=x.reward,
                                                        finish_reason=x.finish_reason, tokens=_plain(x.tokens),
                                                        logprobs=_plain(x.logprobs), spans=x.spans)
                                      for x in g.samples])
            for g in groups]


def _batch_groups(records: Sequence[BatchGroupRecord]) -> list[BatchGroupOut]:
    return [BatchGroupOut(g.group_id, g.prompt_id, tuple(g.prompt), g.task, g.meta, [
                BatchSampleOut(x.sample_id, x.reward, x.finish_reason, bytes(_token_bytes(x.tokens)),
                               bytes(_logprob_bytes(x.logprobs)), _spans(x.spans))
                for x in g.samples])
            for g in records]


def _spans(pairs: Sequence[Sequence[int]]) -> Spans:
    """Stored ``[[version, count], ...]`` as the ledger holds them."""
    return tuple((int(v), int(c)) for v, c in pairs)


def _plain(values) -> list:
    """Python ints/floats (for the snapshot and the messages) from a list, an ``array`` or a numpy array."""
    return values.tolist() if hasattr(values, "tolist") else list(values)
