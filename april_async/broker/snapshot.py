"""The broker core's snapshot: the whole state as one typed ``Snapshot`` (MessagePack, one named
field per part of the state), written by ``encode`` and read back by ``restore``.

The derived indexes are not stored: ``restore`` rebuilds them from the records, then checks them
against the queue orders the snapshot lists (queue order is part of the policy: FIFO fairness).
Anything that cannot be restored is a ``BrokerError`` naming the problem.

Formats (``SNAPSHOT_FORMAT`` is what ``encode`` writes):

- **1**: positional lists (read only, through the one conversion ``_snapshot_from_format_1``);
- **2**: the ``Snapshot`` struct. A field added later gets a default, so that older snapshots of
  the same format still load; anything else is a new format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgpack
import msgspec

from april_async.broker.config import RolloutConfig
from april_async.broker.delivery import BatchGroupOut, BatchOut, BatchSampleOut, _Assembly
from april_async.broker.ledger import (NO_TOKENS, BrokerError, Counters, Group, Lease, Place, Sample,
                                       _logprob_bytes, _logprob_view, _token_bytes, _token_view, offsets_of, runs_of)
from april_async.broker.paged import PagedMap

if TYPE_CHECKING:
    from april_async.broker.core import BrokerCore

SNAPSHOT_FORMAT = 2
"""What ``encode`` writes. 1: positional lists (read only); 2: the ``Snapshot`` struct."""


def encode(core: BrokerCore) -> bytes:
    """The whole state as a MessagePack ``Snapshot`` (queue order included; indexes are not)."""
    a = core._assembly
    snap = Snapshot(
        format=SNAPSHOT_FORMAT,
        config=core.config.model_dump(mode="json"),
        version=core.version,
        next_ids=NextIds(**core._next),
        counters=core.counters,
        prompt_ids=sorted(core.prompt_ids),
        step_groups=sorted(core.step_groups),
        awaiting_version=core.awaiting_version,
        reopened_for=core.reopened_for,
        groups=[GroupRecord(group_id=g.group_id, prompt_id=g.prompt_id, prompt=g.prompt, task=g.task,
                            meta=g.meta, sample_ids=g.sample_ids, admitted_at=g.admitted_at,
                            state=g.state, retire_reason=g.retire_reason) for g in core.groups.values()],
        samples=[SampleRecord(sample_id=s.sample_id, group_id=s.group_id, index=s.index, place=s.place,
                              tokens=_token_view(s.token_bytes).tolist(),
                              logprobs=_logprob_view(s.logprob_bytes).tolist(), spans=s.spans,
                              attempts=s.attempts,
                              lease_id=s.lease_id, finish_reason=s.finish_reason, reward=s.reward,
                              finished_by=s.finished_by, resumed_at=list(s.resumed_at),
                              context=[list(c) for c in s.context], turn=s.turn,
                              step_failures=s.step_failures)
                 for s in core.samples.values()],
        leases=[LeaseRecord(lease_id=x.lease_id, sample_id=x.sample_id, generator=x.generator,
                            deadline=x.deadline, aborting=core._aborting(x)) for x in core.leases.values()],
        scoring=[ScoringRecord(sample_id=sid, scorer=scorer, deadline=deadline)
                 for sid, (scorer, deadline) in core.scoring.items()],
        unacked_batches=[_batch_record(b) for b in core.unacked_batches.values()],
        assembly=None if a is None else AssemblyRecord(
            batch_id=a.batch_id, policy_version=a.version, group_ids=list(a.group_ids),
            packed=_group_records(a.groups)),
        ended={place.value: n for place, n in core.ended.items()},
        queues=Queues(fresh=list(core._fresh), recycle=list(core._recycle), unscored=list(core._unscored),
                      done=list(core._done), ready=list(core._ready),
                      live=sorted(core._moved_at, key=core._moved_at.__getitem__)),
    )
    return _SNAPSHOT_ENCODER.encode(snap)


def restore(cls: type[BrokerCore], data: bytes, config: RolloutConfig | None = None) -> BrokerCore:
    """A ``cls`` rebuilt from a snapshot of any format ``read_snapshot`` reads.

    ``config`` overrides the stored one (same shape only): the records go back on a fresh core, the
    groups that ended leave it, the batches and the one being packed are rebuilt, and the indexes
    are rebuilt and put in the snapshot's queue order.
    """
    snap = read_snapshot(data)
    core = cls(_config_of(snap, config))
    core.version = snap.version
    core._next = msgspec.structs.asdict(snap.next_ids)
    core.counters = snap.counters
    core.step_groups = set(snap.step_groups)
    core.awaiting_version = snap.awaiting_version
    core.reopened_for = snap.reopened_for
    _restore_ledger(core, snap)
    for b in snap.unacked_batches:
        core.unacked_batches[b.batch_id] = BatchOut(b.batch_id, b.policy_version, _batch_groups(b.groups))
    delivering = _restore_assembly(core, snap.assembly)
    missing = sorted(({x.sample_id for x in snap.leases} | set(core.scoring)) - set(core.samples))
    if missing:
        raise BrokerError(
            f"snapshot is inconsistent: leases or score requests name unknown samples {missing}")
    core._rebuild_indexes()
    for gid in delivering:  # chosen for the batch being packed: out of the queues already
        core._done.pop(gid, None)
        core._ready.pop(gid, None)
    _restore_queue_order(core, snap.queues)
    return core


def _config_of(snap: Snapshot, config: RolloutConfig | None) -> RolloutConfig:
    """The config to restore with: ``config`` when given (the stored group size), else the stored one."""
    try:
        stored = RolloutConfig.model_validate(snap.config)
    except ValueError as e:
        raise BrokerError(f"snapshot holds an invalid config: {e}") from None
    if config is not None and config.group_size != stored.group_size:
        raise BrokerError(f"snapshot has group_size={stored.group_size}, config says {config.group_size}")
    return config or stored


def _restore_ledger(core: BrokerCore, snap: Snapshot) -> None:
    """Groups, samples, leases and score requests; groups that had ended leave the ledger."""
    for g in snap.groups:
        core.groups[g.group_id] = Group(g.group_id, g.prompt_id, tuple(g.prompt), g.task, g.meta,
                                        tuple(g.sample_ids), g.admitted_at, g.state, g.retire_reason)
    for s in snap.samples:
        try:
            tokens = bytearray(_token_bytes(s.tokens)) if s.tokens else NO_TOKENS
            logprobs = bytearray(_logprob_bytes(s.logprobs)) if s.logprobs else NO_TOKENS
        except OverflowError as e:
            raise BrokerError(f"snapshot is inconsistent: sample {s.sample_id} holds {e}") from None
        core.samples[s.sample_id] = Sample(s.sample_id, s.group_id, s.index, s.place, tokens, logprobs,
                                           runs_of(s.spans), s.attempts, s.lease_id, s.finish_reason, s.reward,
                                           s.finished_by, offsets_of(s.resumed_at), runs_of(s.context), s.turn,
                                           s.step_failures)
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


def _restore_assembly(core: BrokerCore, a: AssemblyRecord | None) -> list[int]:
    """The batch being packed, checked against the groups the ledger has in state ``delivering``
    (which it returns)."""
    delivering = [g.group_id for g in core.groups.values() if g.state == "delivering"]
    if a is not None:
        pending = a.group_ids[len(a.packed):]
        if sorted(pending) != sorted(delivering) or [g.group_id for g in a.packed] != a.group_ids[:len(a.packed)]:
            raise BrokerError(f"snapshot is inconsistent: batch {a.batch_id} being packed lists groups "
                              f"{a.group_ids}, the ledger has {sorted(delivering)} still to pack")
        core._assembly = _Assembly(a.batch_id, a.policy_version, list(a.group_ids), _batch_groups(a.packed))
    elif delivering:
        raise BrokerError(f"snapshot is inconsistent: groups {delivering} are being delivered in no batch")
    return delivering


def _restore_queue_order(core: BrokerCore, queues: Queues) -> None:
    """Queue order is part of the policy (FIFO fairness): the indexes rebuilt from the samples must
    hold what the snapshot lists, and take the snapshot's order."""
    for name in Queues.__struct_fields__:
        ids = getattr(queues, name)
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


# One struct per part of the state, every field named.


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
    resumed_at: list[int] = []  # since 2026-11-26: absent in older snapshots (no resume known)
    context: list[list[int]] = []  # since issue 45: [[offset, count], ...] observations; absent: none
    turn: int = 0  # since issue 45: observations received; absent: a single-turn sample
    step_failures: int = 0  # since issue 45 item 8: failed runs of the current step sent again


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


class BatchSampleRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    sample_id: int
    reward: float
    finish_reason: str
    tokens: list[int]
    logprobs: list[float]
    spans: list[list[int]]
    resumed_at: list[int] = []  # written only when not empty: a snapshot without resumes is as before
    context: list[list[int]] = []  # since issue 45, written only when not empty


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
    reopened_for: int | None = None  # async per_step: the batch whose report reopened the step


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
                                                        logprobs=_plain(x.logprobs), spans=x.spans,
                                                        resumed_at=list(x.resumed_at),
                                                        context=[list(c) for c in x.context])
                                      for x in g.samples])
            for g in groups]


def _batch_groups(records: Sequence[BatchGroupRecord]) -> list[BatchGroupOut]:
    return [BatchGroupOut(g.group_id, g.prompt_id, tuple(g.prompt), g.task, g.meta, [
                BatchSampleOut(x.sample_id, x.reward, x.finish_reason, bytes(_token_bytes(x.tokens)),
                               bytes(_logprob_bytes(x.logprobs)), runs_of(x.spans), offsets_of(x.resumed_at),
                               runs_of(x.context))
                for x in g.samples])
            for g in records]


def _plain(values) -> list:
    """Python ints/floats (for the snapshot and the messages) from a list, an ``array`` or a numpy array."""
    return values.tolist() if hasattr(values, "tolist") else list(values)
