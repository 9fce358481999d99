"""The broker core: the rollout ledger and the APRIL policy as a pure state machine (plain data,
no I/O, no clock reads), one class built from one module per mechanism:

- ``ledger.py``: the records (``Sample``, ``Group``, ``Lease``, ``Counters``), the places, the
  indexes kept in step by ``_move``, and the audit (conservation);
- ``policy.py``: the APRIL rules — admission, leases, reports, scores, early termination, staleness;
- ``delivery.py``: batches of B whole groups, packed a slice at a time, and their acknowledgements;
- ``snapshot.py``: the whole state as a typed ``Snapshot``, its formats and their migration.

``BrokerCore`` is ``Delivery`` (over ``Policy``, over ``Ledger``) plus the snapshot. Its methods
call each other through ``self``, so a subclass that overrides one (the planted bugs of
``tests/property/test_planted.py``) changes it everywhere. The names callers import from here
(``BrokerCore``, ``BrokerError``, ``Place``, ``LeaseGrant``, ``AbortLease``, ``BatchOut``, ...) are
re-exported from their modules.
"""

from __future__ import annotations

from april_async.broker import snapshot
from april_async.broker.config import RolloutConfig
from april_async.broker.delivery import BatchGroupOut, BatchOut, BatchSampleOut, Delivery
from april_async.broker.ledger import (HELD_PLACES, LOGPROB_DTYPE, LOGPROB_TYPECODE, NO_TOKENS, TOKEN_DTYPE,
                                       TOKEN_TYPECODE, BrokerError, Counters, Group, Lease, Ledger, Place, Sample,
                                       Spans)
from april_async.broker.paged import FifoSet, PagedFifoSet
from april_async.broker.policy import AbortLease, LeaseGrant, Policy, ScoreTask
from april_async.broker.snapshot import SNAPSHOT_FORMAT, Snapshot, read_snapshot

__all__ = [
    "HELD_PLACES", "LOGPROB_DTYPE", "LOGPROB_TYPECODE", "NO_TOKENS", "SNAPSHOT_FORMAT", "TOKEN_DTYPE",
    "TOKEN_TYPECODE", "AbortLease", "BatchGroupOut", "BatchOut", "BatchSampleOut", "BrokerCore", "BrokerError",
    "Counters", "Delivery", "FifoSet", "Group", "Lease", "LeaseGrant", "Ledger", "PagedFifoSet", "Place", "Policy",
    "Sample", "ScoreTask", "Snapshot", "Spans", "read_snapshot",
]


class BrokerCore(Delivery):
    """The rollout ledger, the APRIL policy and the batches, with snapshots. See the module docstring."""

    def to_bytes(self) -> bytes:
        """The whole state as a MessagePack ``Snapshot`` (queue order included; indexes are not)."""
        return snapshot.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes, config: RolloutConfig | None = None) -> BrokerCore:
        """Rebuild a core from a snapshot of any format ``read_snapshot`` reads.

        ``config`` overrides the stored one (same shape only). Anything that cannot be restored is a
        ``BrokerError`` naming the problem.
        """
        return snapshot.restore(cls, data, config)
