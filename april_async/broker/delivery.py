"""Delivery: B whole, scored, in-bound groups a batch for the learner, packed a slice at a time,
and the batches sent but not yet acknowledged.

A batch is chosen, numbered and versioned at its first slice (``pull_batch``): its groups leave
the ready queue, a new version cannot make them stale (they are in bound at the batch's version),
and in sync/april the next rollout step waits for a version newer than the batch's. Each slice
moves whole groups to ``delivered``; their token buffers leave with the batch. A batch stays in
``unacked_batches`` until the learner acknowledges it (``ack_batches``), so that one lost on the
way is sent again (``unacked_batch_after``). ``report_batch`` counts the groups the learner left
out and reopens the rollout step when no step was taken.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Sequence

import msgspec
import numpy as np

from april_async.broker.config import RolloutConfig
from april_async.broker.ledger import (NO_RUNS, NO_TOKENS, Counters, PackedRuns, Runs, Sample,
                                       _bump, _logprob_view, _token_view, pairs)
from april_async.broker.policy import Policy


class BatchSampleOut(PackedRuns, msgspec.Struct, frozen=True, gc=False):
    """One delivered sample. The batch types are frozen msgspec Structs rather than frozen
    dataclasses: built 8× faster (0.06 µs against 0.5 µs; 64,000 a batch at 1,000 generators), and
    never tracked by the garbage collector (``gc=False``: they hold no reference cycles)."""

    sample_id: int
    reward: float
    finish_reason: str
    token_bytes: bytearray | bytes  # packed TOKEN_DTYPE: the sample's own buffer, handed over (it keeps none)
    logprob_bytes: bytearray | bytes  # packed LOGPROB_DTYPE, likewise
    span_runs: Runs  # the sample's, packed (``Sample.span_runs``)
    resumed_offsets: bytes = b""  # ``resumed_at`` packed: where a lease resumed it (the KV cache written again)
    context_runs: Runs = NO_RUNS  # the sample's context (observations), packed

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



LET_GO_SAMPLES_PER_YOUNG_COLLECTION = 256
"""The collector's young generation is collected after this many samples of acknowledged groups
are let go. CPython counts every object freed against those allocated since its last young
collection, which it runs once 700 more were allocated than freed: a group let go (about 2.5
tracked tuples, lists and dicts a sample) holds it back, and with none run while a batch drained,
the young generation grew to 60,000-75,000 objects and took 15-36 ms to collect. 256 samples are
about 700 objects."""


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
        runs = s.span_runs
        if not runs:
            return
        by_version = self.tokens_by_version
        oldest = None
        for version, count in pairs(runs):
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


class Delivery(Policy):
    """The batches of a ``BrokerCore``. See the module docstring."""

    def __init__(self, config: RolloutConfig):
        super().__init__(config)
        # Batches sent but not yet acknowledged by the learner, kept whole so that a batch lost
        # on the way (a broker crash right after ``pull_batch``) can be sent again.
        self.unacked_batches: dict[int, BatchOut] = {}
        self._assembly: _Assembly | None = None  # a batch being packed (``pull_batch`` in slices)
        # The groups of acknowledged batches, let go one per accepted chunk (``_accept``), not all at
        # once, and how many of their samples went since the last young collection.
        self._letting_go: deque[BatchGroupOut] = deque()
        self._let_go_samples = 0

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
            chosen = self._ready.take(B)
            done, groups = self._done, self.groups
            for gid in chosen:
                done.pop(gid, None)
                groups[gid].state = "delivering"
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
            samples = self.samples.values_of(g.sample_ids)
            self._deliver(g, samples)  # first: it refuses a group not all scored before anything changes
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
                                    s.span_runs, s.resumed_offsets, s.context_runs)
                     for s in samples],
                )
            )
            for s in samples:
                tally.add(s)
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

    def report_batch(self, batch_id: int, policy_version: int, dropped_groups: Sequence[int], reason: str) -> None:
        """The learner is done with ``batch_id``: count the groups it left out under ``reason``.

        A report whose ``policy_version`` is not newer than the batch's means no step was taken
        (every group was filtered). In sync/april the next rollout step waits for a newer version,
        which will not come for this batch, so the step is reopened here; so is async's count of
        groups a version with ``per_step`` admission.
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
        elif newest and self.config.mode == "async" and self.config.counts_steps:
            # async with per_step admission counts groups per version: a batch that made none
            # would leave the count spent, and two such batches could leave no group to lease.
            out = self.unacked_batches.get(batch_id)
            # once per batch: a redelivered report must change nothing (invariant 2), and the step
            # it reopens has leased groups of its own by then
            if out is not None and policy_version <= out.policy_version and self.reopened_for != batch_id:
                self.reopened_for = batch_id
                self.counters.steps_skipped += 1
                self._open_next_step()

    def ack_batches(self, upto_batch_id: int) -> bool:
        """The learner holds every batch up to ``upto_batch_id``: forget them. True if any was.

        Their groups are let go one per chunk accepted after this (``_accept``), not here. Freed at
        once, a batch held a 1,000-generator broker twice: its 128,000 token buffers, of as many
        sizes as there are response lengths, took 70-150 ms to free, and glibc's malloc then sorted
        the freed chunks into its large bins (a walk over the sizes a bin holds, for each) inside
        whichever later allocation missed its caches, 10,000 a call: 30-240 ms in the next
        ``lease``, ``finish``, ``admit`` or ``publish_version``; the rest of the batch (a quarter
        of a million tuples, lists and structs scattered over the heap) 30-40 ms. One group a chunk
        drains at least n times as fast as batches fill it (docs/benchmarks.md, "Scale").
        """
        done = [bid for bid in self.unacked_batches if bid <= upto_batch_id]
        for bid in done:
            self._letting_go.extend(self.unacked_batches.pop(bid).groups)
        return bool(done)

    def _accept(self, s, offset, tokens, logprobs, spans) -> int | None:
        if self._letting_go:  # where buffers are made, an acknowledged group goes (``ack_batches``)
            self._let_go_samples += len(self._letting_go.popleft().samples)
            if self._let_go_samples >= LET_GO_SAMPLES_PER_YOUNG_COLLECTION:
                self._let_go_samples = 0
                gc.collect(0)
        return super()._accept(s, offset, tokens, logprobs, spans)

    def unacked_batch_after(self, batch_id: int | None) -> BatchOut | None:
        """The oldest sent batch the learner has not acknowledged (``batch_id``: its newest)."""
        for bid, batch in self.unacked_batches.items():
            if batch_id is None or bid > batch_id:
                return batch
        return None
