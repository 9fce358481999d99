"""The journal's records: one typed record per call that changes the broker core, and ``apply``,
which makes that call.

The service builds a record for each such call, applies it (``apply``) and appends it to the
journal (``encode``); a recovery decodes each record (``decode``) and applies it the same way, so
a record's shape is written here once, and a replay makes exactly the calls the live broker made.
Every record carries the ``now`` its call was made with where the call takes one; the core is
deterministic, so the same records on the same snapshot rebuild the same state.

Record formats (``RECORD_FORMAT`` is what ``encode`` writes; ``decode`` reads both, record by
record, since one log segment holds the records of a broker before and after an upgrade):

- **1** (up to issue 26): a MessagePack array ``[method, [args...]]``, the core method's name and
  its positional arguments; a ``progress`` message was ``["progress", [entries, token bytes,
  log-prob bytes, now]]``.
- **2**: a MessagePack map, one of the structs below, its ``type`` naming it (a tagged union).
  A field added later gets a default, so that older records still decode; anything else is a new
  record type or a new format.

A record whose call returns nothing is still journaled (the call counted something), except the
two queries in ``JOURNALED_WHEN_GIVEN``: a lease call that granted nothing changed nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import msgspec
import numpy as np

from april_async.broker.ledger import LOGPROB_TYPECODE, TOKEN_TYPECODE
from april_async.wire.messages import LOGPROB_DTYPE as WIRE_LOGPROB_DTYPE
from april_async.wire.messages import TOKEN_DTYPE as WIRE_TOKEN_DTYPE

if TYPE_CHECKING:
    from april_async.broker.core import BrokerCore

RECORD_FORMAT = 2
"""What ``encode`` writes. 1: ``[method, args]`` arrays (read only); 2: the tagged structs below."""

SpanList = list[tuple[int, int]]  # [(version, count), ...]: the versions of a chunk's tokens, run-length


class Admit(msgspec.Struct, tag="admit"):
    """A prompt from the source, admitted as a group (``BrokerCore.admit``)."""

    prompt_id: str
    prompt: list[int]
    now: float
    task: str = ""
    meta: dict[str, Any] = {}


class RefusePrompt(msgspec.Struct, tag="refuse_prompt"):
    """A prompt ``admit`` refused, counted so that a restart skips it too."""

    prompt_id: str


class Leases(msgspec.Struct, tag="lease"):
    """Leases dealt to a generator (journaled only when it got some)."""

    generator: str
    max_leases: int
    now: float


class Chunk(msgspec.Struct, tag="chunk"):
    """A token chunk of a lease."""

    lease_id: int
    offset: int
    tokens: list[int]
    logprobs: list[float]
    spans: SpanList
    now: float


class Progress(msgspec.Struct, tag="progress"):
    """A ``progress`` message: many leases' chunks, each entry ``(lease, sample, offset, count,
    spans)`` taking the next ``count`` tokens of the packed arrays."""

    entries: list[tuple[int, int, int, int, SpanList]]
    tokens: bytes  # packed as the message carries them (``wire.messages.TOKEN_DTYPE``)
    logprobs: bytes  # likewise (``wire.messages.LOGPROB_DTYPE``)
    now: float


class Finish(msgspec.Struct, tag="finish"):
    """The last chunk of a lease, and why it ended (stop, length, abort, error)."""

    lease_id: int
    offset: int
    tokens: list[int]
    logprobs: list[float]
    spans: SpanList
    reason: str
    now: float


class ScoreLeases(msgspec.Struct, tag="score_lease"):
    """Score requests dealt to a scorer (journaled only when it got some)."""

    scorer: str
    max_tasks: int
    now: float


class Scored(msgspec.Struct, tag="scored"):
    """A reward for the response that ``lease_id`` finished."""

    sample_id: int
    lease_id: int
    reward: float
    now: float


class Observed(msgspec.Struct, tag="observed"):
    """An environment's observation for the turn that ``lease_id`` finished (issue 45)."""

    sample_id: int
    lease_id: int
    tokens: list[int]
    now: float


class ScoreFailed(msgspec.Struct, tag="score_failed"):
    """A reward function failed; the sample's group retires under ``reason``."""

    sample_id: int
    lease_id: int
    now: float
    reason: str = "score_error"


class RequeueScore(msgspec.Struct, tag="requeue_score"):
    """An unanswered score request, offered again (the service decided it had expired)."""

    sample_id: int


class Reclaim(msgspec.Struct, tag="reclaim"):
    """A lease taken back from its generator (expired, or not reported at its hello)."""

    lease_id: int


class PeerGone(msgspec.Struct, tag="peer_gone"):
    """A peer said bye or went silent: its leases and score requests come back."""

    peer: str
    now: float


class PublishVersion(msgspec.Struct, tag="publish_version"):
    """A new policy version."""

    version: int
    now: float


class PullBatch(msgspec.Struct, tag="pull_batch"):
    """A slice of the batch being packed (``max_samples`` None: the whole batch)."""

    now: float
    max_samples: int | None = None


class ReportBatch(msgspec.Struct, tag="report_batch"):
    """What the learner made of a batch: the version it trained, the groups it left out and why."""

    batch_id: int
    policy_version: int
    dropped_groups: list[int]
    reason: str


class AckBatches(msgspec.Struct, tag="ack_batches"):
    """The learner holds every batch up to ``upto_batch_id``."""

    upto_batch_id: int


Record = (Admit | RefusePrompt | Leases | Chunk | Progress | Finish | ScoreLeases | Scored | ScoreFailed
          | Observed | RequeueScore | Reclaim | PeerGone | PublishVersion | PullBatch | ReportBatch
          | AckBatches)

JOURNALED_WHEN_GIVEN = (Leases, ScoreLeases)
"""Queries that change the core only when they return something: journaled only then."""

_BY_TAG: dict[str, type] = {t.__struct_config__.tag: t for t in Record.__args__}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Record)


class RecordError(ValueError):
    """A journal record that is no record of any format this broker reads."""


def encode(record: Record) -> bytes:
    """``record`` in format ``RECORD_FORMAT``."""
    return _ENCODER.encode(record)


def decode(data: bytes) -> Record:
    """The record in ``data``, whatever format wrote it (see the module docstring)."""
    first = data[0] if data else None
    if first is not None and (0x90 <= first <= 0x9F or first in (0xDC, 0xDD)):  # an array: format 1
        return _from_format_1(data)
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise RecordError(f"journal record is malformed: {e}") from None


def _from_format_1(data: bytes) -> Record:
    """The one conversion from format 1: ``[method, args]`` becomes the method's record, its
    arguments taken in order as they were passed (not converted: the replay makes the same call)."""
    try:
        method, args = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return _BY_TAG[method](*args)
    except KeyError as e:
        raise RecordError(f"journal record (format 1) names no call this broker journals: {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise RecordError(f"journal record (format 1) is malformed: {e}") from None


def apply(core: BrokerCore, record: Record) -> Any:
    """Make the call ``record`` stands for on ``core`` and return what it returned. (Class patterns
    without positional captures: a capture costs a ``__match_args__`` lookup each, 1 µs a chunk.)"""
    match record:
        case Progress():
            arrays = ledger_arrays(np.frombuffer(record.tokens, WIRE_TOKEN_DTYPE),
                                   np.frombuffer(record.logprobs, WIRE_LOGPROB_DTYPE))
            return apply_progress(core, record.entries, *arrays, record.now)
        case Chunk():
            return core.chunk(record.lease_id, record.offset, record.tokens, record.logprobs, record.spans, record.now)
        case Finish():
            return core.finish(record.lease_id, record.offset, record.tokens, record.logprobs, record.spans,
                               record.reason, record.now)
        case Leases():
            return core.lease(record.generator, record.max_leases, record.now)
        case ScoreLeases():
            return core.score_lease(record.scorer, record.max_tasks, record.now)
        case Scored():
            return core.scored(record.sample_id, record.lease_id, record.reward, record.now)
        case ScoreFailed():
            return core.score_failed(record.sample_id, record.lease_id, record.now, record.reason)
        case Observed():
            return core.observed(record.sample_id, record.lease_id, record.tokens, record.now)
        case Admit():
            return core.admit(record.prompt_id, record.prompt, record.now, record.task, record.meta)
        case RefusePrompt():
            return core.refuse_prompt(record.prompt_id)
        case PullBatch():
            return core.pull_batch(record.now, record.max_samples)
        case ReportBatch():
            return core.report_batch(record.batch_id, record.policy_version, record.dropped_groups, record.reason)
        case AckBatches():
            return core.ack_batches(record.upto_batch_id)
        case PublishVersion():
            return core.publish_version(record.version, record.now)
        case Reclaim():
            return core.reclaim(record.lease_id)
        case RequeueScore():
            return core.requeue_score(record.sample_id)
        case PeerGone():
            return core.peer_gone(record.peer, record.now)
    raise RecordError(f"not a journal record: {record!r}")


def ledger_arrays(tokens: np.ndarray, logprobs: np.ndarray) -> tuple[array, array]:
    """A message's token and log-prob arrays as ``array``s of the types the ledger holds: the core
    appends a slice of one of those as packed bytes, where a list slice is converted value by value
    and a numpy slice widened per call (the core's ``chunk`` of a 16-token entry, measured: 2.1 us
    from these, 2.3 from numpy slices, 2.9 from list slices)."""
    out_tokens, out_logprobs = array(TOKEN_TYPECODE), array(LOGPROB_TYPECODE)
    out_tokens.frombytes(tokens.astype(out_tokens.typecode, copy=False).tobytes())
    out_logprobs.frombytes(logprobs.astype(out_logprobs.typecode).tobytes())
    return out_tokens, out_logprobs


def apply_progress(core: BrokerCore, entries: Sequence, tokens: Sequence[int], logprobs: Sequence[float],
                   now: float) -> None:
    """Apply the entries of a ``progress`` (``(lease, sample, offset, count, [(version, count),
    ...])``) to the core in order, each as a ``chunk`` of its slice of ``tokens`` and
    ``logprobs``; the live message and its record both go through here."""
    chunk, pos = core.chunk, 0
    for lease_id, _, offset, count, spans in entries:
        end = pos + count
        chunk(lease_id, offset, tokens[pos:end], logprobs[pos:end], spans, now)
        pos = end
