"""A discrete-event simulation of a cluster around the *real* broker core.

G simulated generators, each with S decode slots, take leases from the real ``BrokerCore``
(every decision — leases, early termination, recycling, staleness — is the core's, through its
public methods, with the calls the broker service makes: admit to keep two steps' worth of
samples queued, lease into free slots, finish, score_lease/scored (and observed), pull_batch,
publish_version, report_batch). Scoring is instant (a trajectory's tool takes ``tool_s``: below);
the learner takes ``train_s`` per batch and then publishes the next policy version; generators
load it at once.

The generator model. A generator runs decode steps back to back while it has active sequences;
a step with k active sequences takes ``a + b·k`` seconds and gives each of them one token, made
by the policy version the generator held when the step began. Sequences that start at a step
boundary (fresh, or a resumed partial) are first prefilled, ``prefill`` seconds per token of
prompt and resumed response, while the others wait. Everything that reaches a generator from
outside — a new lease, an abort, a new version — takes effect at its next step boundary, as on
a real engine (an aborted sequence keeps the token of the step in flight). Free slots are
offered leases first come, first served.

Sample lengths come from a workload (``april_async/sim/workload.py``) keyed by the sample id
(= prompt index · n + k), so every mode, and a resumed partial, sees the same true lengths.

Trajectories (``SimSettings.turns`` = K). Every prompt is admitted under the task the rollout
config lists in ``environments`` (``max_turns`` = K), so each sample is K policy turns, as an
agent's conversation with a tool. Turn k's length comes from the workload scaled to the turn
budget (``turn_budget``: K turns and K − 1 of the longest observations fit the response budget),
keyed by (sample, k). A turn ends with ``stop``; the core moves the sample to ``stepping`` and the
simulated scorer answers it: every turn but the last with an observation of ``observation_min``
to ``observation_max`` tokens (16–64, drawn from the sample and turn) through ``observed``,
``tool_s`` seconds later (the tool's time: the sample sits in ``stepping`` meanwhile); the last
turn, or one after which no observation fits, with a reward through ``scored``, at once. The core
then leases the next turn as a recycled partial; a generator resumes it (prompt, turns and
observations prefilled) and decodes to the end of that turn. The scorer remembers each sample's
turns, and the delivered batches are counted by them (mean turns per delivered sample).

Jumps. Between two events a generator's set of active sequences does not change, so every step
costs the same and every active sequence gains one token per step: the simulation does not visit
the steps one by one. A generator's next event is the step boundary at which its earliest
sequence ends, or the first boundary after something reached it (a lease, an abort, a version:
a publish gives every busy generator an event at its next boundary, so no jump crosses a
version change). The tokens in between are counted in bulk: a generator keeps a timeline of the
step index at which each version began on it, and a sequence's version spans are that timeline
cut to the steps it was active. ``step_by_step=True`` visits every step and records each token's
version one at a time: the reference the jumps are tested against (the same core calls, so the
same counters).

Measured: per mode, over the batches after the warm-up, finished groups and useful tokens (the
tokens delivered to the learner) per simulated second, the slot idle fraction (1 − busy
slot-seconds / capacity) and the fraction of generator-time with no active sequence, the
off-policy token fraction, the tokens dropped by staleness restarts; over the whole run, the
wall-clock cost of every call into the core (``time.perf_counter`` around each real call, per
kind of call) and of every full garbage collection (the collector runs as in a broker process).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field, replace

import msgspec

from april_async.broker.config import BrokerServiceConfig, RolloutConfig
from april_async.broker.core import AbortLease, BrokerCore
from april_async.scorer.config import ScorerConfig
from april_async.engines.base import version_runs
from april_async.sim.config import SIM_TASK, SimError, SimSettings, turn_budget
from april_async.sim.workload import parse_workload

BATCH_SLICE_SAMPLES = BrokerServiceConfig.model_fields["batch_slice_samples"].default  # as the service packs

# pull_empty: a pull_batch call that found no batch; observed: a trajectory's turn answered by its tool
CORE_CALLS = ("admit", "lease", "finish", "score_lease", "scored", "observed", "pull_batch", "pull_empty",
              "ack_batches", "report_batch", "publish_version")
_TOKEN, _LOGPROB = 7, -1.0
SCORE_LEASE_TASKS = ScorerConfig.model_fields["capacity"].default
"""Score tasks one ``score_lease`` call takes: a scorer's default capacity, what the service asks
for a scorer with every slot free (one call for every finished sample made a call of thousands of
tasks, each with its token lists, that no broker makes)."""
SLOW_CALL_US = 1_000.0
"""A call over this wall time has its CPU time kept too (``SimResult.slow_calls``)."""


@dataclass
class SimResult:
    mode: str
    r: float
    eta: int
    sim_seconds: float  # the measured window (batches after the warm-up)
    batches: int
    groups: int
    useful_tokens: int  # tokens delivered to the learner in the window
    generated_tokens: int
    off_policy_tokens: int
    discarded_tokens: int  # dropped by staleness restarts in the window
    recycled: int  # partials resumed in the window
    idle_fraction: float  # 1 − busy slot-seconds / (G · S · seconds)
    empty_fraction: float  # generator-time with no active sequence
    wall_s: float
    latency_us: dict[str, array]  # core call -> its durations, µs (the whole run)
    gc_pauses_ms: array  # every full (generation 2) garbage collection in the run, ms
    gc_cpu_ms: array  # ... the CPU time of each (a collection the OS descheduled took longer than it worked)
    # core call -> (index, wall, CPU) of each call over SLOW_CALL_US (µs; index: its place in
    # ``latency_us[call]``): whether a slow call worked that long, or the OS ran something else meanwhile
    # (a 2-core machine's other processes, a VM's steal)
    slow_calls: dict[str, list[tuple[int, float, float]]] = field(repr=False)
    counters: dict = field(repr=False)  # the core's counters at the end of the run
    ledger_ok: bool = True
    turns: int = 0  # K: policy turns of a trajectory (0: single-turn samples)
    observations: int = 0  # turns answered with an observation, in the window
    observation_tokens: int = 0  # their tokens (delivered ones are among the useful tokens)
    turns_finished: int = 0  # turns of trajectories that ended, in the window
    turns_demoted: int = 0  # trajectories over η whose stale turns became context, in the window
    samples_delivered: int = 0  # in the window
    turns_delivered: int = 0  # the policy turns of the samples delivered in the window
    turn_counts: dict[int, int] = field(default_factory=dict, repr=False)  # turns -> delivered samples (run)
    repeats: int = 1  # runs of the same calls whose least time per call this holds (``least_of``)

    @property
    def turns_per_sample(self) -> float:
        """Mean policy turns of a delivered sample (trajectories; 0 otherwise)."""
        return self.turns_delivered / max(1, self.samples_delivered)

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.sim_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.sim_seconds

    @property
    def off_policy_fraction(self) -> float:
        return self.off_policy_tokens / max(1, self.useful_tokens)

    @property
    def discarded_fraction(self) -> float:
        return self.discarded_tokens / max(1, self.generated_tokens)

    def latency(self, call: str) -> tuple[float, float, int]:
        """p50 and p99 of one kind of core call (µs), and how many there were."""
        xs = self.latency_us.get(call, ())
        if not xs:
            return math.nan, math.nan, 0
        return *median_p99(xs), len(xs)

    def max_us(self, call: str) -> float:
        """The slowest call of one kind (µs; 0 when there was none)."""
        return max(self.latency_us.get(call, ()), default=0.0)

    def max_cpu_us(self, call: str) -> float:
        """The most CPU time one call of a kind took, among those over ``SLOW_CALL_US`` of wall time
        (µs; 0 when none was): the core's own cost of its slowest calls."""
        return max((cpu for _, _, cpu in self.slow_calls.get(call, ())), default=0.0)

    def row(self) -> dict:
        """The numbers as a flat dict (JSON, CSV)."""
        out = {"mode": self.mode, "r": self.r, "eta": self.eta, "sim_seconds": self.sim_seconds,
               "batches": self.batches, "groups_per_s": self.groups_per_s, "tokens_per_s": self.tokens_per_s,
               "idle_fraction": self.idle_fraction, "empty_fraction": self.empty_fraction,
               "off_policy_fraction": self.off_policy_fraction, "discarded_tokens": self.discarded_tokens,
               "discarded_fraction": self.discarded_fraction, "recycled": self.recycled, "wall_s": self.wall_s,
               "ledger_ok": self.ledger_ok, "gc_full": len(self.gc_pauses_ms),
               "gc_full_ms": sum(self.gc_pauses_ms), "gc_full_max_ms": max(self.gc_pauses_ms, default=0.0),
               "turns": self.turns, "observations": self.observations,
               "observation_tokens": self.observation_tokens,
               "turns_finished": self.turns_finished, "turns_demoted": self.turns_demoted,
               "turns_per_sample": self.turns_per_sample, "repeats": self.repeats}
        for call in CORE_CALLS:
            p50, p99, n = self.latency(call)
            out[f"{call}_p50_us"], out[f"{call}_p99_us"], out[f"{call}_calls"] = p50, p99, n
            out[f"{call}_max_us"] = self.max_us(call)
        return out


def median_p99(xs) -> tuple[float, float]:
    """The median and the 99th percentile (nearest rank, the higher) of ``xs``, which is not empty."""
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def least_of(runs: list[SimResult]) -> SimResult:
    """Runs of one mode with the same settings, as one result whose every call took the least time
    it took in any of them.

    The simulation is deterministic (simulated time, seeded draws): every run makes the same core
    calls in the same order, so the i-th call of a kind is the same work in each. What differs is
    the machine: a shared one stalls a thread for milliseconds now and then, and the stall is
    counted as the thread's CPU time (on the development VM a fixed 1 ms of Python took over 10 ms
    of CPU once in about a thousand runs; ``report.machine_noise``). Noise only ever adds time, so
    the least of a few runs is the call's own cost, and a call over the bound in every run is over
    it for real. A slow call's CPU time is kept only for a call over ``SLOW_CALL_US`` of wall time
    in every run; full collections are taken pairwise likewise.

    Raises ``SimError`` when the runs made different calls (counters or call counts differ): then
    the least of them would not compare the same work.
    """
    first = runs[0]
    for other in runs[1:]:
        if other.counters != first.counters or any(
                len(other.latency_us[c]) != len(xs) for c, xs in first.latency_us.items()):
            raise SimError(f"mode {first.mode}: repeated runs made different core calls (the simulation "
                           "is not deterministic), so their times cannot be compared call by call")
    latency = {}
    for call, xs in first.latency_us.items():
        least = array("d", xs)
        for other in runs[1:]:
            least = array("d", map(min, least, other.latency_us[call]))
        latency[call] = least
    slow: dict[str, list[tuple[int, float, float]]] = {}
    for call, found in first.slow_calls.items():
        kept = {i: (wall, cpu) for i, wall, cpu in found}
        for other in runs[1:]:
            theirs = {i: (wall, cpu) for i, wall, cpu in other.slow_calls.get(call, ())}
            kept = {i: (min(w, theirs[i][0]), min(c, theirs[i][1])) for i, (w, c) in kept.items() if i in theirs}
        slow[call] = [(i, w, c) for i, (w, c) in sorted(kept.items())]
    pauses, cpu = first.gc_pauses_ms, first.gc_cpu_ms
    for other in runs[1:]:
        if len(other.gc_pauses_ms) == len(pauses):  # the same collections: each its least
            pauses = array("d", map(min, pauses, other.gc_pauses_ms))
            cpu = array("d", map(min, cpu, other.gc_cpu_ms))
        elif max(other.gc_cpu_ms, default=0.0) < max(cpu, default=0.0):  # else the run with the lesser worst
            pauses, cpu = other.gc_pauses_ms, other.gc_cpu_ms
    return replace(first, latency_us=latency, slow_calls=slow, gc_pauses_ms=pauses, gc_cpu_ms=cpu,
                               wall_s=sum(r.wall_s for r in runs), repeats=sum(r.repeats for r in runs))


class _Grant(msgspec.Struct, gc=False):
    """What a simulated generator keeps of a ``LeaseGrant``: ids and lengths."""

    lease_id: int
    sample_id: int
    prompt_len: int
    held: int  # tokens resumed


class _Slot(msgspec.Struct, gc=False):
    """One sequence decoding on a simulated generator. Not tracked by the garbage collector (it
    holds ints and, in step-by-step mode, one list): the simulated cluster's tens of thousands of
    slots would otherwise be counted in the broker's full collections, which this run measures."""

    lease_id: int
    sample_id: int
    offset: int  # tokens the sample held when this lease started (a resumed partial's)
    start: int  # the generator's step count when this sequence started decoding
    end: int  # the step count at which it reaches its true length
    versions: list[int] | None = None  # step_by_step only: the version of each new token


LEASE_BITS = 48
"""A generator's heap of ends holds ints, ``end step << LEASE_BITS | lease id``, not tuples: a
tuple is an object the garbage collector tracks (one per active sequence, 64,000 at 1,000
generators), and the collections its allocations set off fell inside the broker's calls timed
here, which a real broker, without a simulator in its process, never pays."""
LEASE_MASK = (1 << LEASE_BITS) - 1


@dataclass
class _Gen:
    index: int
    name: str
    slots: dict[int, _Slot] = field(default_factory=dict)  # decoding now
    ends: list[int] = field(default_factory=list)  # heap of end step << LEASE_BITS | lease id; stale ones skipped
    incoming: list[_Grant] = field(default_factory=list)  # leased, start at the next boundary
    aborts: set[int] = field(default_factory=set)  # to stop at the next boundary
    steps: int = 0  # decode steps done as of ``at``
    at: float = 0.0  # the time of its last event: always a step boundary
    seg_t: float = 0.0  # steps of equal cost have run since this time...
    seg_steps: int = 0  # ...from this step count on,
    seg_k: int = 0  # with this many active sequences
    prefill: int = 0  # tokens to prefill before the next step (sequences started at this boundary)
    version: int = 0  # the policy version it holds
    tl_steps: list[int] = field(default_factory=lambda: [0])  # the step index at which...
    tl_versions: list[int] = field(default_factory=lambda: [0])  # ...each version began here
    epoch: int = 0  # only its newest scheduled event is live
    slot_s: float = 0.0  # active sequences × seconds, up to ``at``
    busy_s: float = 0.0  # seconds with at least one active sequence, up to ``at``


# Event kinds; at equal times a publish goes first, then generators by index, then tools' answers.
_PUBLISH, _GEN, _TOOL = 0, 1, 2


class Simulation:
    """One mode: ``spec.generators`` simulated generators around one real ``BrokerCore``."""

    def __init__(self, rollout: RolloutConfig, spec: SimSettings = SimSettings()):
        if spec.generators * spec.slots < rollout.group_size:
            raise SimError(f"{spec.generators} generators × {spec.slots} slots cannot hold a group of "
                           f"{rollout.group_size}")
        self.cfg, self.spec = rollout, spec
        self.core = BrokerCore(rollout)
        self.workload = parse_workload(spec.workload, max_tokens=rollout.max_response_tokens, seed=spec.seed)
        self.rng = random.Random(spec.seed)
        self.gens = [_Gen(i, f"gen-{i}") for i in range(spec.generators)]
        self.by_name = {g.name: g for g in self.gens}
        self.hungry: dict[int, None] = {}  # generators with free slots, first come first served
        self.events: list[tuple[float, int, int, int, int, int]] = []  # (time, kind, index, seq, epoch, steps)
        self.seq = 0
        self.now = 0.0
        self.current: _Gen | None = None  # the generator whose boundary is being processed
        self.learning: int | None = None  # the batch the learner trains on
        self.next_prompt = 0
        self.queue_target = 2 * rollout.max_inflight_groups * rollout.group_size  # like the service
        self.lengths: dict[int, int] = {}
        self.turns = spec.turns
        if self.turns:
            if SIM_TASK not in rollout.environments or rollout.max_turns != self.turns:
                raise SimError(f"turns={self.turns}: the rollout config must list {SIM_TASK!r} in "
                               f"environments with max_turns={self.turns} (SimSettings.rollout does)")
            cap = turn_budget(rollout.max_response_tokens, self.turns, spec.observation_max)
            cap = min(cap, rollout.turn_tokens or cap)
            if cap < 1:
                raise SimError(f"turns={self.turns}: no room for a turn in max_response_tokens="
                               f"{rollout.max_response_tokens}")
            # A turn's length: the workload at the turn budget (its fractions of the budget scale).
            self.turn_workload = parse_workload(spec.workload, max_tokens=cap, seed=spec.seed)
        self.turn_ends: dict[int, int] = {}  # trajectories: the token count at which a sample's turn ends
        self.turns_of: dict[int, int] = {}  # trajectories: the turns of a sample that got its reward
        self.tool_waits: deque[list[tuple[int, int, int, int, int]]] = deque()  # observations due, in order
        self.turns_delivered = 0
        self.turn_counts: dict[int, int] = {}  # turns -> delivered samples with that many
        self.prompt = [1] * spec.prompt_tokens
        self.latency: dict[str, array] = {c: array("d") for c in CORE_CALLS}  # µs per call
        # (time, counters, slot_s, busy_s, turns delivered) per batch
        self.marks: list[tuple[float, dict, float, float, int]] = []
        self.gc_pauses = array("d")  # ms of each full garbage collection during the run
        self.gc_cpu_ms = array("d")  # ... and the CPU time this thread spent in it
        self._gc_c0 = 0
        self.slow: dict[str, list[tuple[int, float, float]]] = {c: [] for c in CORE_CALLS}  # (index, wall, CPU)
        self._gc_t0 = 0.0

    # ------------------------------------------------------------------ calls into the core

    def _call(self, kind: str, fn, *args):
        c0 = time.thread_time_ns()  # outside the wall interval: it costs ~0.4 µs a read here
        t0 = time.perf_counter()
        out = fn(*args)
        wall = (time.perf_counter() - t0) * 1e6
        cpu = (time.thread_time_ns() - c0) / 1e3
        self.latency[kind].append(wall)
        if wall > SLOW_CALL_US:
            self.slow[kind].append((len(self.latency[kind]) - 1, wall, cpu))
        return out

    def _length(self, sample_id: int) -> int:
        n = self.lengths.get(sample_id)
        if n is None:
            n = self.lengths[sample_id] = self.workload.length(sample_id)
        return n

    def _turn_end(self, sample_id: int) -> int:
        """Trajectories: the token count at which the current turn of ``sample_id`` ends (its first
        turn's, the first time it is asked; ``_observe`` sets the next one's)."""
        end = self.turn_ends.get(sample_id)
        if end is None:
            end = self.turn_ends[sample_id] = self._turn_length(sample_id, 0)
        return end

    def _turn_length(self, sample_id: int, turn: int) -> int:
        return self.turn_workload.length(sample_id * self.turns + turn)

    def _observation_tokens(self, sample_id: int, turn: int) -> int:
        """The length of the observation after ``turn`` of ``sample_id``: a pure function of both
        and the seed (a hash of ints is the same in every process), cheaper than a seeded RNG."""
        lo, hi = self.spec.observation_min, self.spec.observation_max
        return lo + hash((self.spec.seed, sample_id, turn)) % (hi - lo + 1)

    def _admit(self) -> None:
        core = self.core
        task = SIM_TASK if self.turns else ""
        while core.place_counts()["queued"] < self.queue_target:
            self._call("admit", core.admit, f"sim-{self.next_prompt}", self.prompt, self.now, task)
            self.next_prompt += 1

    def _report(self, g: _Gen, slot: _Slot, reason: str) -> None:
        n = g.steps - slot.start
        if slot.versions is not None:
            spans = version_runs(slot.versions)
        else:
            spans = self._spans(g, slot.start, g.steps)
        if reason != "abort" and slot.offset + n >= self.cfg.max_response_tokens:
            reason = "length"
        effects = self._call("finish", self.core.finish, slot.lease_id, slot.offset, [_TOKEN] * n, [_LOGPROB] * n,
                             spans, reason, self.now)
        self._effects(effects)

    @staticmethod
    def _spans(g: _Gen, start: int, stop: int) -> list[list[int]]:
        """Version spans of the steps [start, stop) on ``g``, from its version timeline."""
        spans: list[list[int]] = []
        i = bisect_right(g.tl_steps, start) - 1
        pos, last = start, len(g.tl_steps) - 1
        while pos < stop:
            upto = stop if i == last else min(stop, g.tl_steps[i + 1])
            if upto > pos:
                spans.append([g.tl_versions[i], upto - pos])
            pos, i = max(pos, upto), i + 1
        return spans

    def _effects(self, effects: list[AbortLease]) -> None:
        touched: dict[int, _Gen] = {}
        for e in effects:
            g = self.by_name[e.generator]
            g.aborts.add(e.lease_id)
            if g is not self.current:
                touched[g.index] = g
        for g in touched.values():
            self._schedule(g)

    def _score_and_learn(self) -> None:
        core = self.core
        steps: list[tuple[int, int, int, int, int]] = []  # turns for a tool: (sample, lease, held, turn, n)
        for task in self._score_tasks():
            if self.turns:
                n = self._observation_tokens(task.sample_id, task.turn) if task.takes_observation else 0
                if n and len(task.response) + n < self.cfg.max_response_tokens:  # room for a turn after it
                    steps.append((task.sample_id, task.lease_id, len(task.response), task.turn, n))
                    continue
                self.turns_of[task.sample_id] = task.turn + 1  # its last turn (or the last that fits)
                self.turn_ends.pop(task.sample_id, None)
            self._effects(self._call("scored", core.scored, task.sample_id, task.lease_id,
                                     float(self.rng.random() < 0.5), self.now))
        if steps:
            if self.spec.tool_s > 0:  # every tool takes as long: they come back in the order they went
                self.tool_waits.append(steps)
                self._push(self.now + self.spec.tool_s, _TOOL, 0, 0)
            else:
                self._observe(steps)
        if self.learning is None:  # the learner waits for a batch: the service tries on every tick
            batch = None
            if not core.batch_pending():
                self._call("pull_empty", core.pull_batch, self.now)
            while batch is None and core.batch_pending():  # the service's loop: a slice a turn, at once
                batch = self._call("pull_batch", core.pull_batch, self.now, BATCH_SLICE_SAMPLES)
            if batch is not None:
                # The learner holds it, and so does nobody here: the acknowledgement frees it, as in
                # the service (where only ``unacked_batches`` holds a batch sent).
                batch_id = batch.batch_id
                if self.turns:
                    self._count_turns(batch)
                del batch
                self._call("ack_batches", core.ack_batches, batch_id)
                self._mark()
                self.learning = batch_id
                self._push(self.now + self.spec.train_s, _PUBLISH, 0, 0)

    def _score_tasks(self):
        """Every finished sample's score task, taken as the service takes them: at most a scorer's
        capacity a call (``SCORE_LEASE_TASKS``), each slice handled before the next is asked for."""
        while True:
            tasks = self._call("score_lease", self.core.score_lease, "scorer", SCORE_LEASE_TASKS, self.now)
            if not tasks:
                return
            yield from tasks

    def _observe(self, steps: list[tuple[int, int, int, int, int]]) -> None:
        """The tools answered: each turn's observation goes to the core, and the sample's next turn
        is drawn (it ends that many tokens after the observation)."""
        core, limit = self.core, self.cfg.max_response_tokens
        for sample_id, lease_id, held, turn, n in steps:
            self._effects(self._call("observed", core.observed, sample_id, lease_id, [_TOKEN] * n, self.now))
            self.turn_ends[sample_id] = min(limit, held + n + self._turn_length(sample_id, turn + 1))

    def _tool_answers(self) -> None:
        """A ``_TOOL`` event: the oldest waiting observations come back; their next turns are leased."""
        self._observe(self.tool_waits.popleft())
        self._offer()

    def _count_turns(self, batch) -> None:
        """The turns of a delivered batch's samples (what the scorer remembered of each)."""
        counts, turns_of = self.turn_counts, self.turns_of
        for group in batch.groups:
            for s in group.samples:
                k = turns_of.pop(s.sample_id, 0)
                self.turns_delivered += k
                counts[k] = counts.get(k, 0) + 1

    def _publish(self) -> None:
        core = self.core
        version = core.version + 1
        self._effects(self._call("publish_version", core.publish_version, version, self.now))
        self._call("report_batch", core.report_batch, self.learning, version, [], "")
        self.learning = None
        for g in self.gens:  # every generator loads the new version at its next step boundary
            if g.slots:
                self._schedule(g)
            else:
                self._load_version(g)
        self._score_and_learn()
        self._offer()

    # ------------------------------------------------------------------ generators

    def _offer(self) -> None:
        """Lease to generators with free slots, first come first served, while the core gives any."""
        while self.hungry:
            i = next(iter(self.hungry))
            g = self.gens[i]
            free = self.spec.slots - len(g.slots) - len(g.incoming)
            if free <= 0:
                del self.hungry[i]
                continue
            # Only the lengths are kept: a grant's prompt and resume lists (thousands of ints for a
            # long partial) held until a boundary would be walked by every full collection, which
            # this run charges to the broker (a service turns them into a message at once).
            grants = [_Grant(x.lease_id, x.sample_id, len(x.prompt), x.held)
                      for x in self._call("lease", self.core.lease, g.name, free, self.now)]
            if not grants:
                break  # the core's answer does not depend on who asks: nobody else gets one now
            if len(grants) == free:
                del self.hungry[i]
            if g.slots and g.at < self.now:  # mid-step: they start at its next boundary
                g.incoming.extend(grants)
                self._schedule(g)
            else:  # idle, or at a boundary right now: they start now
                self._advance(g, self.now, g.steps)
                self._load_version(g)
                self._start(g, grants)
                if g is not self.current:
                    self._schedule(g)
            self._admit()  # the service keeps the queue topped up the same way

    def _start(self, g: _Gen, grants: list[_Grant]) -> None:
        exact, turns = self.spec.step_by_step, self.turns
        for grant in grants:
            held = grant.held
            if turns:  # the end of its current turn
                end = self._turn_end(grant.sample_id)
            else:
                end = min(self._length(grant.sample_id), self.cfg.max_response_tokens)
            left = end - held
            if left <= 0:
                raise SimError(f"sample {grant.sample_id} resumed at {held} tokens, past its "
                               f"{'turn' if turns else 'length'}'s end {end}")
            g.slots[grant.lease_id] = _Slot(grant.lease_id, grant.sample_id, held, g.steps, g.steps + left,
                                            [] if exact else None)
            heapq.heappush(g.ends, (g.steps + left) << LEASE_BITS | grant.lease_id)
            g.prefill += grant.prompt_len + held

    def _load_version(self, g: _Gen) -> None:
        """``g`` is at a step boundary: it takes the newest version (weights load instantly)."""
        v = self.core.version
        if v == g.version:
            return
        g.version = v
        if g.tl_steps[-1] == g.steps:
            g.tl_versions[-1] = v
        else:
            g.tl_steps.append(g.steps)
            g.tl_versions.append(v)

    def _advance(self, g: _Gen, t: float, steps: int) -> None:
        """Account the time from ``g.at`` to ``t`` (a step boundary, ``steps`` steps done)."""
        k = len(g.slots)
        elapsed = t - g.at
        if k:
            g.slot_s += elapsed * k
            g.busy_s += elapsed
            if self.spec.step_by_step:
                for _ in range(g.steps, steps):  # at most one step: every boundary is an event
                    for slot in g.slots.values():
                        slot.versions.append(g.version)
        g.steps, g.at = steps, t

    @staticmethod
    def _first_end(g: _Gen) -> float:
        """The step count at which the earliest active sequence of ``g`` ends (inf: none)."""
        ends, slots = g.ends, g.slots
        while ends and ends[0] & LEASE_MASK not in slots:  # ended or aborted since
            heapq.heappop(ends)
        return ends[0] >> LEASE_BITS if ends else math.inf

    def _dt(self, k: int) -> float:
        return self.spec.step_a_s + self.spec.step_b_s * k

    def _next_boundary(self, g: _Gen) -> tuple[float, int]:
        """The first step boundary of ``g`` at or after now: (time, steps done by then)."""
        if not g.slots:
            return self.now, g.steps
        dt = self._dt(g.seg_k)
        j = max(g.steps - g.seg_steps, math.ceil((self.now - g.seg_t) / dt - 1e-9))
        return g.seg_t + j * dt, g.seg_steps + j

    def _schedule(self, g: _Gen) -> None:
        """Push ``g``'s next event (its older ones are dropped when popped)."""
        if not g.slots:
            if g.incoming or g.aborts:  # cannot happen: an idle generator starts its leases at once
                raise SimError(f"{g.name} is idle with work pending")
            g.epoch += 1
            return
        if g.at == self.now and (g.seg_k != len(g.slots) or g.prefill):
            # At a boundary: steps of a new cost start here, after prefilling what started here
            # (more sequences started at this same boundary add to a prefill begun here).
            begin = g.seg_t if g.seg_steps == g.steps and g.seg_t > self.now else self.now
            g.seg_t, g.seg_steps, g.seg_k = begin + self.spec.prefill_s * g.prefill, g.steps, len(g.slots)
            g.prefill = 0
        if g.incoming or g.aborts or g.version != self.core.version:
            t, steps = self._next_boundary(g)
        else:  # the boundary where its earliest sequence ends (step_by_step: the next one)
            steps = g.steps + 1 if self.spec.step_by_step else self._first_end(g)
            t = g.seg_t + (steps - g.seg_steps) * self._dt(g.seg_k)
        g.epoch += 1
        self._push(t, _GEN, g.index, g.epoch, steps)

    def _push(self, t: float, kind: int, index: int, epoch: int, steps: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, index, self.seq, epoch, steps))

    def _boundary(self, g: _Gen, steps: int) -> None:
        """``g`` reached a step boundary: report what ended, apply what reached it, lease, go on."""
        self.current = g
        self._advance(g, self.now, steps)
        changed = False
        while self._first_end(g) <= g.steps:
            slot = g.slots.pop(heapq.heappop(g.ends) & LEASE_MASK)
            self._report(g, slot, "stop")
            changed = True
        while g.aborts:
            lid = g.aborts.pop()
            slot = g.slots.pop(lid, None)
            if slot is not None:
                self._report(g, slot, "abort")
                changed = True
                continue
            for grant in g.incoming:
                if grant.lease_id == lid:  # aborted before it started: nothing to report but that
                    g.incoming.remove(grant)
                    effects = self._call("finish", self.core.finish, lid, grant.held, [], [], [], "abort",
                                         self.now)
                    self._effects(effects)
                    changed = True
                    break
        self._load_version(g)
        if g.incoming:
            self._start(g, g.incoming)
            g.incoming = []
            changed = True
        if changed:
            self._score_and_learn()
            if len(g.slots) < self.spec.slots:
                self.hungry[g.index] = None
            self._offer()
        self.current = None
        self._schedule(g)

    # ------------------------------------------------------------------ the run

    def _mark(self) -> None:
        slot_s = busy_s = 0.0
        for g in self.gens:  # the accounts of every generator, carried to now
            k = len(g.slots)
            slot_s += g.slot_s + (self.now - g.at) * k
            busy_s += g.busy_s + (self.now - g.at if k else 0.0)
        self.marks.append((self.now, self.core.counters.as_dict(), slot_s, busy_s, self.turns_delivered))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0, self._gc_c0 = time.perf_counter(), time.thread_time_ns()
        elif info["generation"] == 2:
            self.gc_pauses.append((time.perf_counter() - self._gc_t0) * 1e3)
            self.gc_cpu_ms.append((time.thread_time_ns() - self._gc_c0) / 1e6)

    def run(self) -> SimResult:
        """Run until ``warmup + batches`` batches went out. Python's cyclic garbage collector
        runs as usual (it is part of what a broker process pays); its full collections are timed.
        What exists before the run (modules, this simulation) is frozen out of them first, as the
        broker service freezes its start-up before serving (``BrokerService.run``)."""
        gc.collect()  # each mode starts clean, not with the garbage of the one before
        gc.freeze()
        gc.callbacks.append(self._on_gc)
        try:
            return self._run()
        finally:
            gc.callbacks.remove(self._on_gc)
            gc.unfreeze()  # the next mode freezes its own start

    def _run(self) -> SimResult:
        spec = self.spec
        wall0 = time.perf_counter()
        self._mark()  # the start: time 0, nothing done
        self._admit()
        self.hungry = dict.fromkeys(range(spec.generators))
        self._offer()
        want = spec.warmup + spec.batches
        events = self.events
        while self.core.counters.batches_delivered < want:
            if not events:
                raise SimError(f"mode {self.cfg.mode}: the run stalled after {self.core.counters.batches_delivered} "
                               f"batches (nothing in flight, nothing to lease)")
            t, kind, index, _, epoch, steps = heapq.heappop(events)
            if kind == _GEN:
                g = self.gens[index]
                if epoch != g.epoch:
                    continue
                self.now = t
                self._boundary(g, steps)
            elif kind == _PUBLISH:
                self.now = t
                self._publish()
            else:
                self.now = t
                self._tool_answers()
        return self._result(time.perf_counter() - wall0)

    def _result(self, wall_s: float) -> SimResult:
        spec, cfg = self.spec, self.cfg
        (t0, c0, s0, b0, k0), (t1, c1, s1, b1, k1) = self.marks[spec.warmup], self.marks[-1]
        span = t1 - t0
        if span <= 0:
            raise SimError(f"mode {cfg.mode}: the measured batches took no simulated time")
        d = {k: c1[k] - c0[k] for k in ("groups_delivered", "tokens_delivered", "tokens_generated",
                                         "off_policy_tokens", "tokens_discarded", "partials_recycled",
                                         "observations", "tokens_observed", "turns_finished", "turns_demoted",
                                         "samples_delivered")}
        core = self.core
        ledger_ok = core.audit()["balanced"]
        return SimResult(
            mode=cfg.mode, r=cfg.over_provision, eta=cfg.staleness_bound, sim_seconds=span,
            batches=len(self.marks) - 1 - spec.warmup, groups=d["groups_delivered"],
            useful_tokens=d["tokens_delivered"], generated_tokens=d["tokens_generated"],
            off_policy_tokens=d["off_policy_tokens"], discarded_tokens=d["tokens_discarded"],
            recycled=d["partials_recycled"],
            idle_fraction=max(0.0, 1.0 - (s1 - s0) / (span * spec.generators * spec.slots)),
            empty_fraction=max(0.0, 1.0 - (b1 - b0) / (span * spec.generators)),
            wall_s=wall_s, latency_us=self.latency, gc_pauses_ms=self.gc_pauses, gc_cpu_ms=self.gc_cpu_ms,
            slow_calls=self.slow, counters=core.counters.as_dict(),
            ledger_ok=ledger_ok, turns=self.turns, observations=d["observations"],
            observation_tokens=d["tokens_observed"], turns_finished=d["turns_finished"],
            turns_demoted=d["turns_demoted"], samples_delivered=d["samples_delivered"],
            turns_delivered=k1 - k0,
            turn_counts=dict(sorted(self.turn_counts.items())))
