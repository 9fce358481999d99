"""The ledger: where every admitted sample is, its records, the indexes over them, and the audit.

Every sample of every admitted group is in exactly one *place* (``Place``); ``_move`` is the one
way a sample changes place, and it keeps every index in step. The records are untracked msgspec
Structs (``Sample``, ``Group``, ``Lease``); the counters a user plots are ``Counters``. The rules
that decide the moves (the APRIL policy) are ``policy.py``'s; the batches, ``delivery.py``'s.

A group that ends (delivered or retired) leaves the ledger at once, with its samples (``_forget``):
the place counts keep them (``place_counts`` is exact over the whole run), the counters keep their
tokens, and ``samples``/``groups`` hold only what is still live. So memory, full garbage
collections and the snapshot stay the size of the work in flight, not of the run.

``audit`` checks conservation: every admitted sample in exactly one place, every accepted token
held, delivered, discarded or retired.
"""

from __future__ import annotations

import enum
import struct
from array import array
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from april_async.broker.config import RolloutConfig
from april_async.broker.paged import FifoSet, PagedFifoSet, PagedMap

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
    STEPPING = "stepping"  # a trajectory's turn ended; awaits its environment's step (reward or observation)
    SCORED = "scored"  # rewarded; its group may not be complete yet
    DELIVERED = "delivered"  # handed to the learner in a batch
    RETIRED = "retired"  # its group was retired, with a counted reason


HELD_PLACES = (Place.PARTIAL, Place.FINISHED, Place.STEPPING, Place.SCORED)

# The members as module names for the hot paths: in Python 3.11 ``Place.X`` runs a descriptor
# (60 ns, several per move), a global is a dict lookup.
_QUEUED, _LEASED, _PARTIAL, _FINISHED, _SCORED, _DELIVERED, _RETIRED = (
    Place.QUEUED, Place.LEASED, Place.PARTIAL, Place.FINISHED, Place.SCORED, Place.DELIVERED, Place.RETIRED)
_STEPPING = Place.STEPPING


class BrokerError(ValueError):
    """A request the broker refuses (the message names the offending value)."""


Spans = tuple[tuple[int, int], ...]
"""Run-length versions of a sample's tokens, ``((version, count), ...)``, as the ledger's readers see them."""

Runs = bytearray | bytes
"""How a sample holds its ``(a, b)`` pairs: packed, little-endian int64 ``a0 b0 a1 b1 ...``, in a
``bytearray`` extended in place (``NO_RUNS`` while there are none). Bytes are no container to the
garbage collector: never tracked, never walked. Tuples cost a multi-turn cluster
(``tools/simulate.py --turns 8``) up to 17 ms of CPU a collection: a tuple of pairs is untracked
only once its pairs are, and CPython visits it before them, so one made while its sample was being
served reached the oldest generation tracked; and a small tuple from CPython's free list is tracked
without counting as an allocation, so the tens of thousands a chunk-heavy interval replaced piled up
in the young generation past its threshold. (An ``array.array`` is no better: since 3.11 it is
tracked, and never untracked: 40,000 of them made full collections of 150 ms at 1,000 generators.)"""

NO_RUNS = b""
_PAIR = struct.Struct("<qq")
_INT = struct.Struct("<q")


NO_OFFSETS = b""


def offsets_of(items: Iterable[int]) -> bytes:
    """Ints (a snapshot's or the wire's ``resumed_at``) as a sample holds them: packed int64, as
    ``Runs`` and for the same reason (a tuple of them is one more young object a turn)."""
    return b"".join(_INT.pack(int(k)) for k in items)


def new_runs(a: int, b: int) -> bytearray:
    return bytearray(_PAIR.pack(a, b))


def add_run(runs: bytearray, a: int, b: int) -> None:
    runs += _PAIR.pack(a, b)


def last_run(runs: Runs) -> tuple[int, int]:
    return _PAIR.unpack_from(runs, len(runs) - _PAIR.size)


def grow_last(runs: bytearray, n: int) -> None:
    """Add ``n`` to the last pair's ``b``."""
    at = len(runs) - _INT.size
    _INT.pack_into(runs, at, _INT.unpack_from(runs, at)[0] + n)


def firsts(runs: Runs) -> memoryview:
    """The ``a`` of every pair (a view: use it at once, a bytearray cannot grow while one exists)."""
    return memoryview(runs).cast("q")[0::2]


def seconds(runs: Runs) -> memoryview:
    """The ``b`` of every pair (a view, as ``firsts``)."""
    return memoryview(runs).cast("q")[1::2]


def pairs(runs: Runs) -> Spans:
    """The packed pairs as ``((a0, b0), (a1, b1), ...)``."""
    return tuple(_PAIR.iter_unpack(runs))


def runs_of(items: Iterable[Sequence[int]]) -> Runs:
    """Pairs, as a snapshot or the wire holds them, as a sample holds them."""
    out = bytearray()
    for a, b in items:
        out += _PAIR.pack(int(a), int(b))
    return out if out else NO_RUNS


# The ledger's records are msgspec Structs with ``gc=False``: never tracked by the cyclic garbage
# collector (they hold no reference cycles: ints, strings, enum members, arrays and tuples of
# ints), so a full collection does not visit the hundreds of thousands of live samples of a
# 1,000-generator cluster. As dataclasses, each sample was two tracked objects (itself and its
# ``__dict__``) plus its span lists, and full collections grew with the ledger.


class PackedRuns:
    """``spans``, ``context`` and ``resumed_at`` read from a struct's packed ``span_runs``,
    ``context_runs`` and ``resumed_offsets`` (``Sample``, and the delivered ``BatchSampleOut``). No
    state of its own."""

    __slots__ = ()
    span_runs: Runs
    context_runs: Runs
    resumed_offsets: bytes

    @property
    def resumed_at(self) -> tuple[int, ...]:
        """Response offsets at which a lease resumed it (prefilling the tokens before again)."""
        return tuple(k for (k,) in _INT.iter_unpack(self.resumed_offsets))

    @property
    def spans(self) -> Spans:
        """Run-length versions of its tokens, ``((version, count), ...)``."""
        return pairs(self.span_runs)

    @property
    def context(self) -> Spans:
        """The response's context (observations, demoted turns): ``((offset, count), ...)``."""
        return pairs(self.context_runs)


class Sample(PackedRuns, msgspec.Struct, gc=False):
    sample_id: int
    group_id: int
    index: int  # 0 .. n-1 within its group
    place: Place = Place.QUEUED
    token_bytes: bytearray | bytes = NO_TOKENS  # packed TOKEN_DTYPE (see NO_TOKENS)
    logprob_bytes: bytearray | bytes = NO_TOKENS  # packed LOGPROB_DTYPE
    span_runs: Runs = NO_RUNS  # the ``spans``, packed
    attempts: int = 0  # leases issued for it
    lease_id: int | None = None
    finish_reason: str | None = None
    reward: float | None = None
    finished_by: int | None = None  # the lease that finished it; scores must name it
    resumed_offsets: bytes = NO_OFFSETS  # the ``resumed_at``, packed
    context_runs: Runs = NO_RUNS  # the ``context``, packed: (offset, count) of the response's context: observations
    turn: int = 0  # a trajectory's policy turns before the one in progress (observations received)
    step_failures: int = 0  # failed runs of its current step sent again (``on_env_failure = "retry"``)

    @property
    def oldest_version(self) -> int | None:
        return _oldest_of(self.span_runs) if self.span_runs else None

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
    turns_finished: int = 0  # turns of trajectories that ended, each sent to its environment (issue 45)
    observations: int = 0  # turns of trajectories answered with an observation (issue 45)
    tokens_observed: int = 0  # the observations' tokens, appended as context
    turns_demoted: int = 0  # trajectories over η whose stale tokens became context instead of a restart
    tokens_demoted: int = 0  # those tokens
    score_errors: int = 0
    steps_retried: int = 0  # failed environment steps sent to a scorer again (``on_env_failure = "retry"``)
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


def _oldest_of(runs: Runs) -> int:
    """The oldest version in a sample's non-empty ``span_runs``."""
    return min(firsts(runs))


class Ledger:
    """The samples, groups, leases and score requests of a ``BrokerCore``, and the indexes over them.

    State that the policy and the delivery keep of their own is set up by their classes
    (``Policy``, ``Delivery``); this class knows the places, not the rules that move samples.
    """

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
        # Lease ids only grow; ~64,000 live at 1,000 generators, and as dicts these two rebuilt their
        # tables whole once per that many leases (5-13 ms of CPU in one lease call): paged.
        self.leases: PagedMap = PagedMap()  # lease id -> Lease
        self.scoring: dict[int, tuple[str, float]] = {}  # sample_id -> (scorer, deadline)
        self.counters = Counters()
        self.prompt_ids: dict[str, None] = {}  # of the open groups (a dict: not tracked by the collector)
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
        # tells every one of them at once: it empties this map and raises ``_aborted_below`` (every
        # lease issued before it is aborting) instead of flagging each lease.
        self._unaborted: PagedMap = PagedMap()  # lease id -> generator
        self._aborted_below = 0
        self._place_counts: dict[Place, int] = dict.fromkeys(Place, 0)
        self._place_counts.update(self.ended)
        # group -> its samples leased / at their environment / finished or scored / scored (no entry: none)
        self._n_leased: dict[int, int] = {}
        self._n_stepping: dict[int, int] = {}
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

    def _unindex_oldest_each(self, sids: list[int]) -> None:
        """``_unindex_oldest`` of every sample of ``sids`` (a group's), one call per index and bucket."""
        by_version: dict[int, list[int]] = {}
        for sid, version in zip(sids, self._oldest.pop_each(sids, None)):
            if version is not None:
                by_version.setdefault(version, []).append(sid)
        for version, of_version in by_version.items():
            bucket = self._by_oldest[version]
            bucket.pop_each(of_version)
            if not bucket:
                del self._by_oldest[version]

    def _index_add(self, s: Sample) -> None:
        place, sid, gid = s.place, s.sample_id, s.group_id
        self._place_counts[place] += 1
        if place is _DELIVERED or place is _RETIRED:
            self._moved_at.pop(sid, None)
            self._unindex_oldest(sid)
            return
        self._moved_at[sid] = self._moves
        self._moves += 1
        if s.span_runs:
            self._index_oldest(sid, _oldest_of(s.span_runs))
        else:
            self._unindex_oldest(sid)
        if place is _QUEUED:
            self._fresh[sid] = None
        elif place is _PARTIAL:
            self._recycle[sid] = None
        elif place is _LEASED:
            self._n_leased[gid] = self._n_leased.get(gid, 0) + 1
        elif place is _STEPPING:  # out for a step like a finished sample for its reward; its group not done
            self._n_stepping[gid] = self._n_stepping.get(gid, 0) + 1
            if sid not in self.scoring:
                self._unscored[sid] = None
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
        elif place is _STEPPING:
            _count_down(self._n_stepping, gid)
            self._unscored.pop(sid, None)
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
        if s.place is _FINISHED or s.place is _STEPPING:
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
        tokens_ok = (c.tokens_generated + c.tokens_observed
                     == held + c.tokens_delivered + c.tokens_discarded + c.tokens_retired)
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

    def _take(self, kind: str) -> int:
        value = self._next[kind]
        self._next[kind] = value + 1
        return value

    # ------------------------------------------------------------------ leases and ended groups

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

    def _set_aborting(self, lease: Lease) -> None:
        lease.aborting = True
        self._unaborted.pop(lease.lease_id, None)

    def _aborting(self, lease: Lease) -> bool:
        """Whether ``lease`` was told to abort: flagged alone, or by an early termination."""
        return lease.aborting or lease.lease_id < self._aborted_below

    def _deliver(self, g: Group, samples: list[Sample]) -> None:
        """Ready group ``g``'s ``samples`` (every one scored) are delivered: what ``_move`` to
        ``DELIVERED`` does to each, done once for the group where it can be (its counts) and in one
        call per index for the rest. The group was chosen for a batch, so it is out of the done
        and ready queues already (``Delivery.pull_batch``). A batch holds 64,000 samples at 1,000
        generators; one ``_move`` each made its slices 3–4 ms of 512 samples. Checked before
        anything changes: a sample not scored is a ``BrokerError``."""
        gid, n = g.group_id, len(samples)
        for s in samples:
            if s.place is not _SCORED:
                raise BrokerError(f"group {gid} delivered with sample {s.sample_id} {s.place.value}, not scored")
        for s in samples:
            s.place = _DELIVERED
        counts = self._place_counts
        counts[_SCORED] -= n
        counts[_DELIVERED] += n
        self._n_done.pop(gid, None)
        self._n_scored.pop(gid, None)
        ids = g.sample_ids
        self._moved_at.pop_each(ids, None)
        self._unindex_oldest_each(ids)

    def _forget(self, g: Group) -> None:
        """Group ``g`` ended: it and its samples leave the ledger; ``ended`` counts them."""
        ended = self.ended
        for s in self.samples.pop_each(g.sample_ids):
            ended[s.place] += 1
        del self.groups[g.group_id]
        self.prompt_ids.pop(g.prompt_id, None)

    def rebase_deadlines(self, now: float) -> None:
        """After a restart the old clock's deadlines mean nothing: give every peer a full timeout."""
        for lease in self.leases.values():
            lease.deadline = now + self.config.lease_timeout_s
        for sid, (scorer, _) in self.scoring.items():
            self.scoring[sid] = (scorer, now + self.config.score_timeout_s)
