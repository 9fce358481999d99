"""The broker service: the pure core behind a ZeroMQ ROUTER, with a write-ahead journal.

Loop: poll the hub (with a timeout) → handle each message → tick (expiry, dead peers,
admission, leases, score requests, batches, heartbeats with acks, journal flush, snapshot).

Journaling rule: every call that changes the core is made through a typed record
(``records.py``), which is appended to the journal *before* any message it causes is sent, with
the ``now`` it was called with; the core is deterministic, so replaying the records after the
newest snapshot rebuilds the exact state. Expiry decisions are journaled as ``Reclaim`` /
``RequeueScore`` records (heartbeats move deadlines and are not journaled), and lease calls that
granted nothing are not written at all. A ``progress`` message (many leases' tokens) is one
``Progress`` record, applied live and on replay by the same ``apply_progress``.

Refusals (``error`` ``refused``, nothing acted on, nothing journaled): a message from a sender
with no session; a message type the role its sender said ``hello`` as may not send
(``wire.roles``, SPEC's message table); and a message that moves the policy version (``hello``
with a version, ``batch_request``, ``batch_report``, ``weights_published``) from a learner or
broadcaster instance other than the one whose session moves it now (``_mover``).
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from april_async.broker import records as r
from april_async.broker.allocator import allocator_in_use
from april_async.broker.config import BrokerServiceConfig, RolloutConfig
from april_async.broker.core import LOGPROB_DTYPE, TOKEN_DTYPE, AbortLease, BatchOut, BrokerCore, BrokerError
from april_async.broker.ledger import Place
from april_async.broker.records import apply_progress, ledger_arrays
from april_async.logs import get_logger
from april_async.telemetry import Families, Histogram
from april_async.model.tokenizer import chat_messages
from april_async.tasks.source import PromptSource, encode_prompt, uses_chat
from april_async.transport.hub import Hub
from april_async.wire import messages as m
from april_async.wire import roles

if TYPE_CHECKING:
    from april_async.broker.journal import Journal


@dataclass
class PeerState:
    role: str
    identity: bytes
    instance: str = ""
    capacity: int = 0
    incarnation: str = ""  # the process behind the session (protocol 1.8; "": not stated)
    acks: deque = field(default_factory=deque)  # (journal records needed, seq)
    last_heartbeat_sent: float = 0.0


class SampleClock:
    """Seconds from a group's admission to each of its samples' reward, and each sample's turns
    (``broker_state.json``'s ``sample_seconds``): the latency a mode buys its throughput with, and
    how often a trajectory calls its tool. The last ``keep`` samples only. Admission times are the
    broker's clock (the host's monotonic clock, the same after a restart of the broker on that host);
    a duration that is negative or over a day (a ledger recovered on another host) is not timed."""

    def __init__(self, keep: int = 100_000):
        self.seconds: deque[float] = deque(maxlen=keep)
        self.turns: dict[int, int] = {}
        self.n = 0
        self.histogram = Histogram()  # every timed sample, for /metrics

    def add(self, seconds: float, turns: int) -> None:
        self.turns[turns] = self.turns.get(turns, 0) + 1
        if 0.0 <= seconds < 86_400.0:
            self.seconds.append(seconds)
            self.n += 1
            self.histogram.observe(seconds)

    def summary(self) -> dict:
        xs = sorted(self.seconds)
        q = {f"p{p}": round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 4) for p in (50, 90, 99) if xs}
        return {"n": self.n, **q, "max": round(xs[-1], 4) if xs else None,
                "turns": {str(k): v for k, v in sorted(self.turns.items())}}


VERSION_MOVERS = ("learner", "broadcaster")
"""The roles whose messages move the policy version; one instance of each at a time (``_mover``)."""
LEASE_ROUNDS = 8
"""A tick deals its leases in up to this many rounds over the generators (``_lease``)."""
COUNTER_HELP = {
    "groups_admitted": "Groups admitted from the prompt source",
    "duplicate_prompts": "Prompts skipped as duplicates",
    "prompts_refused": "Prompts refused (empty, or over max_prompt_tokens)",
    "leases_issued": "Leases issued to generators",
    "leases_expired": "Leases reclaimed from silent or departed generators",
    "aborts_sent": "Aborts sent to generators",
    "early_terminations": "Steps ended early once their groups were complete (APRIL)",
    "partials_created": "Partial responses kept for a later lease",
    "partials_recycled": "Leases resuming a sample that already had tokens",
    "tokens_resumed": "Tokens carried into resumed leases instead of being generated again",
    "tokens_generated": "Tokens accepted from generators",
    "tokens_duplicate": "Tokens sent again and ignored",
    "tokens_over_budget": "Tokens past max_response_tokens, ignored",
    "chunk_gaps": "Chunks that started beyond what the broker held, ignored",
    "stale_reports": "Reports on unknown or ended leases, ignored",
    "samples_finished": "Samples whose response finished",
    "restarts": "Samples restarted for breaking the staleness bound",
    "tokens_discarded": "Tokens dropped by those restarts",
    "groups_retired": "Groups retired, by reason",
    "tokens_retired": "Tokens of retired groups",
    "scores_ok": "Rewards received",
    "turns_finished": "Trajectory turns sent to their environment",
    "observations": "Trajectory turns answered with an observation",
    "tokens_observed": "Observation tokens appended as context",
    "turns_demoted": "Trajectories over the staleness bound whose stale tokens became context",
    "tokens_demoted": "Tokens made context that way",
    "score_errors": "Score requests answered with an error",
    "steps_retried": "Failed environment steps sent to a scorer again",
    "score_timeouts": "Score requests sent again after score_timeout_s",
    "stale_scores": "Rewards for requests no longer outstanding, ignored",
    "batches_delivered": "Batches delivered to the learner",
    "groups_delivered": "Groups delivered to the learner",
    "samples_delivered": "Samples delivered to the learner",
    "tokens_delivered": "Response tokens delivered to the learner",
    "off_policy_tokens": "Delivered tokens made by a version older than the learner's",
    "staleness_tokens": "Delivered tokens by lag (the learner's version minus the token's)",
    "staleness_samples": "Delivered samples by the lag of their oldest token",
    "version_updates": "Policy versions the broker moved to",
    "groups_filtered": "Delivered groups the learner left out, by reason",
    "steps_skipped": "Batches the learner took no step on",
}
"""The help text of each ledger counter on ``/metrics`` (``april_broker_<name>_total``)."""
METRICS_EVERY_S = 0.5
"""How often the loop copies what ``/metrics`` shows (``_take_snapshot``), when it is served."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """What ``/metrics`` shows of the ledger, copied by the loop at one instant (so that the places
    add up to what was admitted in every scrape)."""

    version: int
    places: dict[str, int]
    counters: dict
    peers: dict[str, int]  # role -> sessions
    group_size: int


class BrokerService:
    def __init__(self, cfg: BrokerServiceConfig, hub: Hub, *, clock=time.monotonic):
        self.cfg = cfg
        self.hub = hub
        self.clock = clock
        self.epoch = os.urandom(6).hex()
        self.log = get_logger(actor="broker", epoch=self.epoch)
        self.peers: dict[str, PeerState] = {}
        self.batch_waiters: deque[tuple[str, str, int | None]] = deque()  # (sender, msg_id, acked batch)
        self.version_right = roles.VersionRight()  # which learner, which broadcaster moves the version
        self.journal: Journal | None = None
        self.records_since_snapshot = 0
        self.sample_clock = SampleClock()
        self.message_seconds: dict[type, Histogram] = {}  # message type -> time to handle one
        self.tick_seconds = Histogram()
        self.snapshot: MetricsSnapshot | None = None
        self._snapshot_due = 0.0
        self.core = self._recover()
        c = self.core.counters
        # The stream is a function of the prompts taken: a restarted broker picks it up where it was.
        self.source = PromptSource(cfg.prompts, start=c.groups_admitted + c.duplicate_prompts + c.prompts_refused)
        self.tokenizer = None
        if cfg.prompts.kind != "synthetic":
            from april_async.model.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(cfg.prompts.tokenizer)
            if cfg.prompts.chat and not self.tokenizer.chat_template:
                raise ValueError(f"broker.prompts.chat = true, but the tokenizer {cfg.prompts.tokenizer!r} ships "
                                 f"no chat template")
        if self.journal is not None:
            self.hub.before_send = self.journal.commit  # write-ahead: records out before effects

    # ------------------------------------------------------------------ journal

    def _recover(self) -> BrokerCore:
        if self.cfg.journal_dir is None:
            return BrokerCore(self.cfg.rollout)
        from april_async.broker.journal import Journal

        self.journal = Journal(Path(self.cfg.journal_dir), durability=self.cfg.durability, interval_s=self.cfg.fsync_interval_s)
        core, replayed, had_snapshot = replay(self.journal, self.cfg.rollout)
        core.rebase_deadlines(self.clock())
        self.records_since_snapshot = replayed
        self.log.info("recovered", snapshot=had_snapshot, records=replayed, version=core.version,
                      **core.place_counts())
        return core

    def apply(self, record: r.Record):
        """Make the call ``record`` stands for and journal it (write-ahead: before anything it causes is sent)."""
        result = r.apply(self.core, record)
        if self.journal is not None and (result or not isinstance(record, r.JOURNALED_WHEN_GIVEN)):
            self.journal.append(r.encode(record))
            self.records_since_snapshot += 1
        return result

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        # Start-up's objects (modules, configs, the recovered ledger) go to the collector's permanent
        # generation: a full collection then walks only what the loop makes (at 1,000 generators in
        # the simulator: 2.5 ms at most, against 14–19 ms).
        gc.collect()
        gc.freeze()
        self.log.info("serving", bind=self.hub.endpoint, mode=self.cfg.rollout.mode, allocator=allocator_in_use())
        while not stop:
            # A batch being packed for a waiting learner: the next slice at once, after what came in.
            busy = bool(self.batch_waiters) and self.core.batch_pending()
            for identity, msg in self.hub.poll(0.0 if busy else self.cfg.link.heartbeat_interval_s / 4):
                t = time.perf_counter()
                self.handle(identity, msg, self.clock())
                kind = type(msg.body)
                hist = self.message_seconds.get(kind) or self.message_seconds.setdefault(kind, Histogram())
                hist.observe(time.perf_counter() - t)
            t = time.perf_counter()
            self.tick(self.clock())
            self.tick_seconds.observe(time.perf_counter() - t)
        self.close()

    def close(self) -> None:
        self.hub.close()
        if self.journal is not None:
            self.journal.flush()
            self.journal.close()
        ledger = self.ledger()
        if self.cfg.state_file is not None:
            Path(self.cfg.state_file).write_text(json.dumps(ledger, indent=2, sort_keys=True, default=str))
        self.log.info("stopped", balanced=ledger["balanced"], places=ledger["places"], **self.core.counters.as_dict())

    def ledger(self) -> dict:
        """Where every sample is, and whether that adds up to what was admitted (conservation)."""
        core = self.core
        audit = core.audit()
        return {"version": core.version, "places": audit["places"], "samples": audit["live"],
                "expected": audit["expected"], "balanced": audit["balanced"],
                "counters": core.counters.as_dict(), "sample_seconds": self.sample_clock.summary()}

    def _clock_sample(self, sample_id: int, now: float) -> None:
        """A reward arrived: time the sample from its group's admission (``SampleClock``)."""
        s = self.core.samples.get(sample_id)
        if s is not None and s.place is Place.SCORED:
            self.sample_clock.add(now - self.core.groups[s.group_id].admitted_at, s.turn + 1)

    def handle(self, identity: bytes, msg, now: float) -> None:
        body, sender = msg.body, msg.sender
        if isinstance(body, m.Hello):
            self._hello(identity, msg, now)
            return
        peer = self.peers.get(sender)
        if peer is None:
            self.hub.send(identity, m.Error(code="refused", message=f"no session for {sender!r}: send hello"),
                          parent_id=msg.msg_id)
            return
        if self._refused(identity, msg, peer.role, peer.instance):
            return
        self.core.touch(sender, now)
        if isinstance(body, m.Progress):
            self._progress(body, now)
        elif isinstance(body, m.Finished):
            if body.reason == "error":
                self.log.warning("engine_refused", lease_id=body.lease_id, sample_id=body.sample_id, generator=sender,
                                 error=body.error)
            self._aborts(self.apply(r.Finish(body.lease_id, body.offset, body.tokens.tolist(), body.logprobs.tolist(),
                                             [(s.version, s.count) for s in body.versions], body.reason, now)))
        elif isinstance(body, m.TokenChunk):
            self.apply(r.Chunk(body.lease_id, body.offset, body.tokens.tolist(), body.logprobs.tolist(),
                               [(s.version, s.count) for s in body.versions], now))
        elif isinstance(body, m.Scored):
            if body.observation is not None:  # a trajectory's next turn (or, where none was asked, bad_step)
                observed = r.Observed(body.sample_id, body.lease_id, list(body.observation), now)
                self._aborts(self.apply(observed))
            elif body.error is not None:
                reason = score_error_kind(body.error)
                self.log.warning("score_failed", sample_id=body.sample_id, scorer=sender, reason=reason, error=body.error)
                self._aborts(self.apply(r.ScoreFailed(body.sample_id, body.lease_id, now, reason)))
            else:
                self._aborts(self.apply(r.Scored(body.sample_id, body.lease_id, body.reward, now)))
                self._clock_sample(body.sample_id, now)
        elif isinstance(body, m.BatchRequest):
            self._version_at_least(body.policy_version, now)
            if body.acked_batch_id is not None and self.core.unacked_batch_after(None) is not None:
                self.apply(r.AckBatches(body.acked_batch_id))
            self.batch_waiters.append((sender, msg.msg_id, body.acked_batch_id))
        elif isinstance(body, m.BatchReport):
            self.apply(r.ReportBatch(body.batch_id, body.policy_version, list(body.dropped_groups), body.reason))
            self._version_at_least(body.policy_version, now)
        elif isinstance(body, m.WeightsPublished):
            self._aborts(self.apply(r.PublishVersion(body.version, now)))
            for name, p in self.peers.items():
                if p.role == "generator":
                    self.hub.send(p.identity, body)
            self.log.info("version", version=body.version, source=body.source)
        elif isinstance(body, m.Heartbeat):
            if body.free_slots is not None and peer.role == "scorer":
                peer.capacity = max(peer.capacity, body.free_slots)
        elif isinstance(body, m.Bye):
            self._peer_gone(sender, now, reason=body.reason or "bye")
            return
        elif isinstance(body, m.Error):
            self.log.warning("peer_error", peer=sender, code=body.code, message=body.message)
        else:
            self.hub.send(identity, m.Error(code="refused", message=f"the broker does not take {msg.msg_type}"),
                          parent_id=msg.msg_id)
        self._note_ack(peer, msg.seq)

    def _progress(self, body: m.Progress, now: float) -> None:
        """Apply every entry of a ``progress`` as its own chunk, and journal the message as one
        ``Progress`` record (``apply_progress`` replays it). The decoder has checked that the entries and the
        arrays add up, so no entry can fail here: either the whole message was refused at the
        border or each entry is applied, or counted as a no-op by the core (stale, gap, duplicate)."""
        entries = msgspec.to_builtins(body.entries)  # [[lease, sample, offset, count, [[v, c], ...]], ...]
        apply_progress(self.core, entries, *ledger_arrays(body.tokens, body.logprobs), now)
        if self.journal is not None:
            self.journal.append(r.encode(r.Progress(entries, body.tokens.tobytes(), body.logprobs.tobytes(), now)))
            # Counted as its entries toward ``snapshot_every_records``: snapshots come as often per
            # token as with one chunk a record, so a recovery replays no more than it did.
            self.records_since_snapshot += len(entries)

    def _note_ack(self, peer: PeerState, seq: int) -> None:
        needed = self.journal.records_appended if self.journal is not None else 0
        peer.acks.append((needed, seq))

    def _refused(self, identity: bytes, msg, role: str, instance: str) -> bool:
        """Refuse (and act on nothing in) a message its sender's role may not send, or may not send
        now (``_mover``); True when it was refused."""
        why = roles.refusal(role, msg.msg_type)
        if why is None and moves_version(msg.body):
            why = self._mover(role, instance)
        if why is None:
            return False
        self.log.warning("refused", peer=msg.sender, role=role, msg_type=msg.msg_type, error=why)
        self.hub.send(identity, m.Error(code="refused", message=why[:500]), parent_id=msg.msg_id)
        return True

    def _mover(self, role: str, instance: str) -> str | None:
        """Claim the right to move the policy version for ``instance`` of ``role`` (``roles.VersionRight``):
        None when it holds it, else why not. A second learner or broadcaster would announce versions of
        weights nobody else has."""
        return self.version_right.claim(role, instance, ((n, p.role, p.instance) for n, p in self.peers.items()))

    def _hello(self, identity: bytes, msg, now: float) -> None:
        body: m.Hello = msg.body
        if self._refused(identity, msg, body.role, body.instance):
            return
        old = self.peers.get(msg.sender)
        # A new process under a known name (protocol 1.8): the old one is dead. What it held ends
        # below as on any hello (leases it cannot list, its score requests); logged as such.
        restarted = old is not None and bool(old.incarnation and body.incarnation) \
            and old.incarnation != body.incarnation
        self.peers[msg.sender] = peer = PeerState(body.role, identity, body.instance, body.capacity,
                                                  body.incarnation or (old.incarnation if old else ""))
        if body.role == "generator":
            held = set(self.core.leases_of(msg.sender))
            reported = {x.lease_id for x in body.inflight}
            for lid in sorted(held - reported):
                self._aborts(self.apply(r.Reclaim(lid)))
            unknown = sorted(reported - held)
            if unknown:
                self.hub.send(identity, m.Abort(lease_ids=unknown))
        elif body.role in ("learner", "broadcaster") and body.policy_version is not None:
            # A version announced to a broker that then died is announced again here.
            self._version_at_least(body.policy_version, now)
        elif body.role == "scorer":
            for sid, (scorer, _) in list(self.core.scoring.items()):
                if scorer == msg.sender:
                    self.apply(r.RequeueScore(sid))
        self.core.touch(msg.sender, now)
        self.hub.send(identity, m.Welcome(
            broker_epoch=self.epoch, policy_version=self.core.version,
            heartbeat_interval_s=self.cfg.link.heartbeat_interval_s, peer_timeout_s=self.cfg.link.peer_timeout_s,
            max_message_bytes=self.cfg.link.max_message_bytes), parent_id=msg.msg_id)
        self._note_ack(peer, msg.seq)
        self.log.info("hello", peer=msg.sender, role=body.role, capacity=body.capacity,
                      inflight=len(body.inflight), **({"restarted": True} if restarted else {}))

    def _version_at_least(self, version: int, now: float) -> None:
        if version > self.core.version:
            self._aborts(self.apply(r.PublishVersion(version, now)))
            self.log.info("version", version=version, source="peer")

    def _peer_gone(self, name: str, now: float, reason: str) -> None:
        self.peers.pop(name, None)
        self.batch_waiters = deque(w for w in self.batch_waiters if w[0] != name)
        self._aborts(self.apply(r.PeerGone(name, now)))
        self.log.info("peer_gone", peer=name, reason=reason)

    def _aborts(self, effects: list[AbortLease]) -> None:
        by_gen: dict[str, list[int]] = {}
        for e in effects:
            by_gen.setdefault(e.generator, []).append(e.lease_id)
        for gen, lids in by_gen.items():
            peer = self.peers.get(gen)
            if peer is not None:
                self.hub.send(peer.identity, m.Abort(lease_ids=lids))

    # ------------------------------------------------------------------ tick

    def tick(self, now: float) -> None:
        for name in self.hub.expired_peers(now):
            if name in self.peers:
                self._peer_gone(name, now, reason="silent")
        leases, scores = self.core.expired(now)
        for lid in leases:
            self._aborts(self.apply(r.Reclaim(lid)))
        for sid in scores:
            self.apply(r.RequeueScore(sid))
        self._admit(now)
        self._lease(now)
        self._score(now)
        self._serve_batches(now)
        if self.journal is not None:
            self.journal.maybe_flush(now)
            if self.records_since_snapshot >= self.cfg.snapshot_every_records:
                self.journal.snapshot(self.core.to_bytes())
                self.records_since_snapshot = 0
        self._heartbeats(now)
        if self.cfg.metrics.port is not None and now >= self._snapshot_due:
            self._snapshot_due = now + METRICS_EVERY_S
            self._take_snapshot()

    # ------------------------------------------------------------------ metrics

    def _take_snapshot(self) -> None:
        core = self.core
        counters = {k: dict(v) if isinstance(v, dict) else v for k, v in core.counters.as_dict().items()}
        peers: dict[str, int] = {}
        for p in self.peers.values():
            peers[p.role] = peers.get(p.role, 0) + 1
        self.snapshot = MetricsSnapshot(version=core.version, places=core.place_counts(), counters=counters,
                                        peers=peers, group_size=self.cfg.rollout.group_size)

    def scrape(self, out: Families) -> None:
        """``/metrics`` (``april_async.telemetry``): the ledger's places and counters as of the loop's
        last snapshot (at most ``METRICS_EVERY_S`` old), and the loop's own timings."""
        snap = self.snapshot
        if snap is not None:
            out.gauge("april_broker_policy_version", "The policy version the broker holds", snap.version)
            for place, n in snap.places.items():
                out.gauge("april_broker_samples", "Samples in each place of the ledger (ended groups' "
                          "samples counted in delivered and retired)", n, place=place)
            out.gauge("april_broker_group_size", "Samples per group", snap.group_size)
            for role in ("generator", "scorer", "learner", "broadcaster"):
                out.gauge("april_broker_sessions", "Peers with a session, by role", snap.peers.get(role, 0),
                          peer_role=role)
            for name, value in snap.counters.items():
                if isinstance(value, dict):
                    label = "lag" if name.startswith("staleness_") else "reason"
                    for key, n in sorted(value.items()):
                        out.counter(f"april_broker_{name}_total", COUNTER_HELP.get(name, name), n,
                                    **{label: key})
                else:
                    out.counter(f"april_broker_{name}_total", COUNTER_HELP.get(name, name), value)
        for kind, hist in list(self.message_seconds.items()):
            out.histogram("april_broker_message_seconds", "Time to handle one message, by its type", hist,
                          type=getattr(kind, "msg_type", kind.__name__))
        out.histogram("april_broker_tick_seconds", "Time of one turn of the loop's periodic work (expiry, "
                      "admission, leases, score requests, batches, journal)", self.tick_seconds)
        out.histogram("april_broker_sample_seconds", "Seconds from a group's admission to each of its "
                      "samples' reward", self.sample_clock.histogram)

    def _admit(self, now: float) -> None:
        """Keep two steps' worth of samples queued, from the prompt source."""
        rollout = self.cfg.rollout
        want = 2 * rollout.max_inflight_groups * rollout.group_size
        while self.core.place_counts()["queued"] < want:
            problem = self.source.next()
            if problem is None:
                return
            prompt = encode_prompt(problem, self.tokenizer, chat=self.cfg.prompts.chat,
                                   system=self.cfg.prompts.system_prompt)
            meta = dict(problem.meta)
            if (problem.task in rollout.environments and problem.prompt_ids is None and "messages" not in meta
                    and uses_chat(self.tokenizer, self.cfg.prompts.chat)):
                # A trajectory's observations are the template's renders of this conversation, later
                # turns appended (the scorer's ``observation_ids``): it travels with the prompt.
                meta["messages"] = chat_messages(problem.prompt, self.cfg.prompts.system_prompt)
            try:
                self.apply(r.Admit(problem.prompt_id, prompt, now, problem.task, meta))
            except BrokerError as e:  # too long, empty: this prompt is skipped, the run goes on
                self.apply(r.RefusePrompt(problem.prompt_id))
                self.log.warning("prompt_refused", prompt_id=problem.prompt_id, error=str(e))

    def _lease(self, now: float) -> None:
        """Deal what may be leased now across the generators with free slots, in rounds, the
        most free first, each taking at most 1/``LEASE_ROUNDS`` of the largest free count a round:
        a step's samples are spread over the generators instead of filling the first (64 slots
        each and 64 samples a sync step put every sample on one generator of two, and the other
        sat idle). The core grants what it may whoever asks, so a short grant ends the tick's leasing."""
        free: dict[str, int] = {}
        for name, peer in self.peers.items():
            if peer.role == "generator" and (n := peer.capacity - len(self.core.leases_of(name))) > 0:
                free[name] = n
        if not free:
            return
        sp = self.cfg.rollout.sampling
        sampling = m.SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                    stop_token_ids=list(sp.stop_token_ids))
        turn_stops = self.cfg.rollout.turn_stop_token_ids
        turn_sampling = sampling if not turn_stops else m.SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            stop_token_ids=list(dict.fromkeys((*sp.stop_token_ids, *turn_stops))))
        quantum = -(-max(free.values()) // LEASE_ROUNDS)
        while free:
            for name in sorted(free, key=free.__getitem__, reverse=True):
                want = min(free[name], quantum)
                grants = self.apply(r.Leases(name, want, now))
                identity = self.peers[name].identity
                for g in grants:
                    self.hub.send(identity, m.Generate(
                        lease_id=g.lease_id, sample_id=g.sample_id, group_id=g.group_id,
                        prompt=np.asarray(g.prompt, dtype=np.int32), resume=g.resume_tokens,
                        max_new_tokens=g.max_new_tokens, sampling=turn_sampling if g.trajectory else sampling,
                        min_policy_version=g.min_policy_version))
                if len(grants) < want:
                    return
                free[name] -= want
                if not free[name]:
                    del free[name]

    def _score(self, now: float) -> None:
        out: dict[str, int] = {}
        for scorer, _ in self.core.scoring.values():
            out[scorer] = out.get(scorer, 0) + 1
        for name, peer in self.peers.items():
            if peer.role != "scorer":
                continue
            free = max(1, peer.capacity) - out.get(name, 0)
            if free <= 0:
                continue
            for t in self.apply(r.ScoreLeases(name, free, now)):
                self.hub.send(peer.identity, m.ScoreRequest(
                    sample_id=t.sample_id, lease_id=t.lease_id, group_id=t.group_id,
                    prompt=np.asarray(t.prompt, dtype=np.int32), response=np.asarray(t.response, dtype=np.int32),
                    finish_reason=t.finish_reason, task=t.task, meta=t.meta, turn=t.turn,
                    context=[m.TokenSpan(o, c) for o, c in t.context], takes_observation=t.takes_observation))

    def _serve_batches(self, now: float) -> None:
        while self.batch_waiters:
            sender, msg_id, acked = self.batch_waiters[0]
            peer = self.peers.get(sender)
            if peer is None:
                self.batch_waiters.popleft()
                continue
            # A batch sent but never acknowledged (lost in a crash, say) goes out again first.
            batch = self.core.unacked_batch_after(acked)
            resent = batch is not None
            if batch is None:
                if not self.core.batch_pending():
                    return
                # A slice per turn of the loop (journaled: each one changes the ledger); the batch
                # comes out of the call that packs its last group.
                batch = self.apply(r.PullBatch(now, self.cfg.batch_slice_samples))
            if batch is None:
                return
            self.batch_waiters.popleft()
            self.hub.send(peer.identity, batch_message(batch, self.core.counters.as_dict()), parent_id=msg_id)
            self.log.info("batch", batch_id=batch.batch_id, learner=sender, version=batch.policy_version, resent=resent)

    def _heartbeats(self, now: float) -> None:
        durable = self.journal.durable_count if self.journal is not None else None
        for peer in self.peers.values():
            if now - peer.last_heartbeat_sent < self.cfg.link.heartbeat_interval_s:
                continue
            ack = None
            while peer.acks and (durable is None or peer.acks[0][0] <= durable):
                ack = peer.acks.popleft()[1]
            self.hub.send(peer.identity, m.Heartbeat(policy_version=self.core.version, ack_seq=ack))
            peer.last_heartbeat_sent = now


def replay(journal: Journal, rollout: RolloutConfig) -> tuple[BrokerCore, int, bool]:
    """Rebuild the core from a journal: the newest snapshot, then every record after it, each
    applied as the live broker applied it (``records.apply``), whatever its record format."""
    snapshot, records = journal.recover()
    core = BrokerCore.from_bytes(snapshot, rollout) if snapshot else BrokerCore(rollout)
    for data in records:
        r.apply(core, r.decode(data))
    return core, len(records), snapshot is not None


def moves_version(body: m.Body) -> bool:
    """Whether the broker takes a policy version from this message (``_version_at_least``,
    ``PublishVersion``): only one instance of a role may send such messages at a time."""
    if isinstance(body, m.Hello):
        return body.role in VERSION_MOVERS and body.policy_version is not None
    return isinstance(body, m.BatchRequest | m.BatchReport | m.WeightsPublished)


SCORE_ERROR_KINDS = frozenset({"reward_error", "reward_timeout", "bad_reward", "env_error", "env_timeout",
                               "bad_step"})


def score_error_kind(error: str) -> str:
    """The reason a failed score is counted under: the scorer's ``<kind>: <detail>`` prefix when known."""
    kind = error.partition(":")[0].strip()
    return kind if kind in SCORE_ERROR_KINDS else "score_error"


def batch_message(batch: BatchOut, stats: dict | None = None) -> m.Batch:
    """The wire form of a core batch: token arrays concatenated, slices in the header. The samples'
    packed buffers are joined as bytes and viewed by numpy once (no Python object per token, none
    per sample's array), and leave as bulk frames."""
    prompts, responses, logprobs, groups = [], [], [], []
    p_off = r_off = 0
    token_size = TOKEN_DTYPE.itemsize
    for g in batch.groups:
        samples = []
        for s in g.samples:
            n = len(s.token_bytes) // token_size
            samples.append(m.BatchSample(sample_id=s.sample_id, reward=s.reward, finish_reason=s.finish_reason,
                                         response_offset=r_off, response_len=n,
                                         versions=[m.VersionSpan(v, c) for v, c in s.spans],
                                         resumed_at=list(s.resumed_at),
                                         context=[m.TokenSpan(o, c) for o, c in s.context]))
            responses.append(s.token_bytes)
            logprobs.append(s.logprob_bytes)
            r_off += n
        groups.append(m.BatchGroup(group_id=g.group_id, prompt_id=g.prompt_id, prompt_offset=p_off,
                                   prompt_len=len(g.prompt), samples=samples, task=g.task, meta=g.meta))
        prompts.extend(g.prompt)
        p_off += len(g.prompt)
    return m.Batch(batch_id=batch.batch_id, policy_version=batch.policy_version, groups=groups,
                   prompt_tokens=np.asarray(prompts, dtype=np.int32),
                   response_tokens=np.frombuffer(b"".join(responses), TOKEN_DTYPE).astype(np.int32, copy=False),
                   logprobs=np.frombuffer(b"".join(logprobs), LOGPROB_DTYPE).astype(np.float32),
                   stats=stats or {})
