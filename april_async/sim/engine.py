"""A discrete-event simulation of a cluster around the *real* broker core.

Simulated generators decode with a step time of ``a + b · active_slots`` seconds, and each
sample has a true response length drawn from a long-tailed distribution (fixed per sample, so a
resumed partial continues toward the same end). Scoring is instant; the learner trains for
``train_s`` per batch and then publishes the next version. Everything the broker decides —
leases, early termination, recycling, staleness — is the real ``BrokerCore``.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from april_async.broker.config import RolloutConfig
from april_async.broker.core import AbortLease, BrokerCore


@dataclass(frozen=True)
class SimSpec:
    generators: int = 2
    slots: int = 16
    step_a_s: float = 1.4e-3  # fixed cost of one decode step
    step_b_s: float = 0.23e-3  # cost per active sequence in that step
    train_s: float = 0.5  # learner time per batch
    median_len: int = 48  # long tail: lognormal lengths, clipped to max_response_tokens
    sigma: float = 1.0
    batches: int = 20
    seed: int = 0


@dataclass
class SimResult:
    mode: str
    sim_seconds: float
    batches: int
    useful_tokens: int
    busy_fraction: float
    counters: dict = field(repr=False)

    @property
    def groups_per_s(self) -> float:
        return self.counters["groups_delivered"] / self.sim_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.sim_seconds


@dataclass
class _Slot:
    lease_id: int
    sample_id: int
    done: int  # tokens of the response so far (resumed ones included)
    target: int
    new_tokens: list = field(default_factory=list)
    new_versions: list = field(default_factory=list)


class Simulation:
    def __init__(self, rollout: RolloutConfig, spec: SimSpec):
        self.cfg, self.spec = rollout, spec
        self.core = BrokerCore(rollout)
        self.rng = random.Random(spec.seed)
        self.now = 0.0
        self.slots: dict[str, dict[int, _Slot]] = {f"gen-{i}": {} for i in range(spec.generators)}
        self.lengths: dict[int, int] = {}
        self.busy_slot_seconds = 0.0
        self.learner_busy_until: float | None = None
        self.next_prompt = 0

    def _length(self, sample_id: int) -> int:
        if sample_id not in self.lengths:
            raw = self.spec.median_len * math.exp(self.rng.gauss(0.0, self.spec.sigma))
            self.lengths[sample_id] = max(1, min(self.cfg.max_response_tokens, round(raw)))
        return self.lengths[sample_id]

    def _keep_queue_full(self) -> None:
        want = 2 * self.cfg.max_inflight_groups
        while self.core.place_counts()["queued"] < want * self.cfg.group_size:
            self.core.admit(f"sim-{self.next_prompt}", [1, 2, 3, 4], self.now)
            self.next_prompt += 1

    def _apply(self, effects: list[AbortLease]) -> None:
        for e in effects:
            slot = self.slots[e.generator].pop(e.lease_id, None)
            if slot is not None:
                self._report(slot, "abort")

    def _report(self, slot: _Slot, reason: str) -> list[AbortLease]:
        toks = slot.new_tokens
        spans: list[list[int]] = []
        for v in slot.new_versions:
            if spans and spans[-1][0] == v:
                spans[-1][1] += 1
            else:
                spans.append([v, 1])
        offset = slot.done - len(toks)
        return self.core.finish(slot.lease_id, offset, toks, [-1.0] * len(toks), spans, reason, self.now)

    def _fill(self, gen: str) -> None:
        free = self.spec.slots - len(self.slots[gen])
        for g in self.core.lease(gen, free, self.now):
            self.slots[gen][g.lease_id] = _Slot(g.lease_id, g.sample_id, len(g.resume), self._length(g.sample_id))

    def _score_and_train(self) -> None:
        for t in self.core.score_lease("scorer", 1 << 30, self.now):
            self._apply(self.core.scored(t.sample_id, t.lease_id, self.rng.random(), self.now))
        if self.learner_busy_until is None and self.core.pull_batch(self.now) is not None:
            self.learner_busy_until = self.now + self.spec.train_s

    def run(self) -> SimResult:
        events: list[tuple[float, int, str]] = []
        for i, gen in enumerate(self.slots):
            heapq.heappush(events, (0.0, i, gen))
        order = len(self.slots)
        while self.core.counters.batches_delivered < self.spec.batches:
            t, _, gen = heapq.heappop(events)
            if self.learner_busy_until is not None and self.learner_busy_until <= t:
                self.now = self.learner_busy_until
                self.learner_busy_until = None
                self._apply(self.core.publish_version(self.core.version + 1, self.now))
                self._score_and_train()
            self.now = t
            self._keep_queue_full()
            self._fill(gen)
            active = self.slots[gen]
            if not active:  # idle: look again after one step's time
                order += 1
                heapq.heappush(events, (t + self.spec.step_a_s, order, gen))
                continue
            step = self.spec.step_a_s + self.spec.step_b_s * len(active)
            self.busy_slot_seconds += step * len(active)
            self.now = t + step
            for lid, slot in list(active.items()):
                if lid not in active:  # aborted by an early termination earlier in this step
                    continue
                slot.new_tokens.append(7)
                slot.new_versions.append(self.core.version)
                slot.done += 1
                if slot.done >= slot.target:
                    del active[lid]
                    self._apply(self._report(slot, "stop"))
            self._score_and_train()
            order += 1
            heapq.heappush(events, (self.now, order, gen))
        capacity = self.now * self.spec.generators * self.spec.slots
        c = self.core.counters.as_dict()
        return SimResult(self.cfg.mode, self.now, c["batches_delivered"], c["tokens_delivered"],
                         self.busy_slot_seconds / capacity if capacity else 0.0, c)
