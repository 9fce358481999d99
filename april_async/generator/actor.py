"""The generator actor: takes leases from the broker, runs them on an engine, streams tokens back.

Per lease it keeps every token it generated, so that after a reconnect (a broker restart, say)
it can re-report the lease in ``hello.inflight`` and re-send its tokens from the start of the
lease (chunks are idempotent by offset). A ``finished`` message is kept until a broker
heartbeat acknowledges its ``seq`` as journaled, and is sent again after a reconnect.

A lease the engine refused for good (``finish = "error"``: a prompt longer than the server's
context, say) is reported as ``finished`` with ``reason = "error"`` and the engine's message
(protocol 1.5); the broker retires the sample's group. A broker older than 1.5 cannot take that
reason: the generator stops with ``ActorFailed`` rather than send it (upgrade the broker).

Tokens go to the broker in flushes: every ``progress_interval_s`` (or once ``progress_max_tokens``
wait) one ``progress`` message carries the new tokens of every lease (protocol 1.7), so the
broker's cost per message is paid once per flush, not once per lease. A broker older than 1.7
gets one ``token_chunk`` per lease every ``chunk_tokens`` tokens instead, as before.

What the engine can do it says in ``engine.caps``, read here once: how its weights arrive picks
the one source of its versions (``weights_link``: the broadcaster when there is one, else the
broker's ``weights_published``; ``weights.link``) and whether a lease waits for the
``min_policy_version`` the broker leased it with; ``batched_abort`` whether an abort of every
lease is one call per server.

Starved of weights. A lease waits for its ``min_policy_version``; when the first waiting lease has
waited ``weights_wait_s`` (the version's fan-out has not reached this generator: its rounds fail,
the broadcaster benched it, it is stuck joining a group), every waiting lease goes back to the
broker (``finished``, reason ``abort``, no tokens: partials another generator resumes) and the
generator offers no slots (a ``hello`` with capacity 0) until a version that new loads (issue 42:
one generator held all the leases of a rollout step for four minutes while the other sat idle).

Mixed tokens. A lease's prompt and resumed tokens are prefilled once, with the weights the engine
holds when it starts; a version loaded while it decodes (an in-flight update: ``async``, and
``april`` with ``boundary = "inflight"``) computes the logits of its later tokens while the cache
still holds the keys and values the older weights wrote. Those tokens, the lease's tokens of a
newer version than its first token's, are neither policy's: the generator counts them
(``mixed_tokens`` in its ``busy`` lines, beside ``tokens``, every token it generated). An engine
that prefills its running requests again at every swap (``engine.on_swap = "recompute"``, AReaL's
way) makes none, and none are counted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from april_async.engines.base import Engine, EngineOutput, EngineRequest, RequestRefused, version_runs
from april_async.generator.config import GeneratorConfig
from april_async.logs import get_logger
from april_async.runtime import ActorFailed, incarnation
from april_async.transport.peer import wait_any
from april_async.weights.link import BrokerNotices, WeightsLink
from april_async.wire import messages as m
from april_async.wire.version import parse

ERROR_REASON_SINCE = (1, 5)  # the protocol version that added finished.reason "error"
PROGRESS_SINCE = (1, 7)  # the protocol version that added the progress message


class BusyClock:
    """How busy an engine is: wall seconds with at least one sequence active, and slot-seconds
    (active sequences × seconds), from the count seen at each turn of the loop."""

    def __init__(self, now: float) -> None:
        self.since = self.at = now
        self.active = 0
        self.busy_s = self.slot_s = 0.0

    def tick(self, now: float, active: int) -> None:
        """The loop turned at ``now`` with ``active`` sequences; the time since the last turn counts
        at the count seen then."""
        dt = now - self.at
        if self.active:
            self.busy_s += dt
            self.slot_s += self.active * dt
        self.at, self.active = now, active


@dataclass
class LeaseWork:
    lease_id: int
    sample_id: int
    start: int  # response offset of the first token generated under this lease (= len(resume))
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sent: int = 0  # tokens of this lease already sent
    group_id: int = -1
    decode_s: float = 0.0  # its share of the engine steps it ran in (``log_leases``)

    def mixed(self, versions: list[int]) -> int:
        """Of ``versions`` (the lease's next tokens), how many are newer than the lease's first token:
        computed by weights loaded after its prefill, over a cache the older weights wrote."""
        first = self.versions[0] if self.versions else (versions[0] if versions else 0)
        return sum(1 for v in versions if v > first)


def weights_link(cfg: GeneratorConfig, engine: Engine, log) -> WeightsLink:
    """Where the generator's versions come from (``weights.link``), chosen once by the engine's
    ``caps.weights``: with a broadcaster, its group (``in_process``) or its pushes to the engine's
    servers (``pushed``); without one, or for an engine with no weights, the broker's notices."""
    if cfg.broadcaster is not None and engine.caps.weights == "in_process":
        from april_async.weights.subscriber import WeightSubscriber

        return WeightSubscriber(cfg.name, cfg.broadcaster, cfg.link, engine, device=engine.device,
                                address=cfg.weights_address)
    if cfg.broadcaster is not None and engine.caps.weights == "pushed":
        from april_async.weights.subscriber import ServerWeightsLink

        return ServerWeightsLink(cfg.name, cfg.broadcaster, cfg.link, engine)
    if cfg.broadcaster is not None:
        log.warning("broadcaster_ignored", reason=f"the {engine.name} engine holds no weights")
    return BrokerNotices(engine, log)


def spans_of(versions: list[int]) -> list[m.VersionSpan]:
    return [m.VersionSpan(v, c) for v, c in version_runs(versions)]


class GeneratorActor:
    def __init__(self, cfg: GeneratorConfig, engine: Engine, peer_factory):
        """``peer_factory(on_connect)`` returns a connected transport ``Peer``."""
        self.cfg = cfg
        self.engine = engine
        self.log = get_logger(actor="generator", instance=cfg.name)
        self.work: dict[int, LeaseWork] = {}
        self.waiting: deque[EngineRequest] = deque()  # leases beyond the engine's free slots
        self._held_back: int | None = None  # the lease last logged as waiting for newer weights
        self._gated_since: float | None = None  # since when the first waiting lease waits for weights
        self.starved_for: int | None = None  # the version it waits for past weights_wait_s: no slots offered
        self.unacked: list[m.Finished] = []  # finished reports not yet journaled by the broker
        self.unacked_seq: list[int] = []
        self.sessions = 0
        self.aborting: set[int] = set()  # leases whose abort a server engine will report through step()
        self.capacity = engine.slots  # what the broker was told (a server engine's shrinks while one is down)
        self.broker_proto: str | None = None  # the broker's proto_version, from its last message
        self.flush_due: float | None = None  # progress: when the oldest unsent token must go out
        self.resend = False  # a new session: send every lease's tokens again, at once
        self.gated = engine.caps.weights != "none"  # a lease waits for the version it needs
        self.tokens_generated = 0  # every token the engine reported (the ``busy`` lines)
        self.mixed_tokens = 0  # of those, tokens after an in-flight update (see the module docstring)
        self.busy: BusyClock | None = None  # the loop's, once it runs
        self.weights = weights_link(cfg, engine, self.log)  # the one source of versions
        self.peer = peer_factory(self._on_connect)

    # ------------------------------------------------------------------ session

    def _on_connect(self, peer) -> None:
        """(Re)open the session: re-report live leases, re-send unacknowledged finishes."""
        self.sessions += 1
        self._hello(peer)
        for w in self.work.values():
            w.sent = 0  # the broker may have lost chunks: send the lease's tokens again from its start
        self.resend = bool(self.work)
        self.broker_proto = None  # a new session may be with another broker: known again from its welcome
        resend, self.unacked, self.unacked_seq = self.unacked, [], []
        for fin in resend:
            self._send_finished(fin, peer)
        if self.sessions > 1:
            self.log.info("reconnected", leases=len(self.work), resent_finishes=len(resend))

    def _hello(self, peer) -> None:
        """Register with the broker: capacity, version, and every lease this process still holds.
        Unacknowledged finishes count as in flight: the broker must keep their leases open until
        the re-sent ``finished`` arrives. Sent again mid-session when the engine's capacity
        changes (a ``hello`` re-registers; the broker keeps the leases it lists)."""
        self.capacity = self.offered()
        inflight = [m.InflightLease(w.lease_id, w.sample_id, w.start + len(w.tokens)) for w in self.work.values()]
        inflight += [m.InflightLease(f.lease_id, f.sample_id, f.offset + len(f.tokens)) for f in self.unacked]
        peer.send(m.Hello(role="generator", instance=self.cfg.name, capacity=self.capacity, engine=self.engine.name,
                          policy_version=self.engine.policy_version, inflight=inflight,
                          incarnation=incarnation()))

    def offered(self) -> int:
        """The slots offered to the broker: the engine's, none while starved of weights."""
        return 0 if self.starved_for is not None else self.engine.slots

    def _capacity_changed(self) -> None:
        """Tell the broker; when it shrank, hand back the leases that have not started (another
        generator can run them now) rather than keep them waiting for a server to return, or for
        weights that do not come."""
        was, free = self.capacity, max(0, self.offered() - self.engine.active())
        returned = 0
        while len(self.waiting) > free:
            lid = self.waiting[-1].lease_id
            self._abort(lid)
            returned += 1
        self.log.info("capacity", was=was, now=self.offered(), leases_returned=returned,
                      **({"starved_for": self.starved_for} if self.starved_for is not None else {}))
        self._hello(self.peer)

    def _check_starved(self, now: float) -> None:
        """Offer no slots while the first waiting lease has waited ``weights_wait_s`` for weights
        (its version's fan-out has not reached this generator), and again once that version loads
        (``weights_wait_s``)."""
        if self.starved_for is not None:
            if self.engine.newest_version >= self.starved_for:
                self.log.info("weights_arrived", version=self.engine.newest_version,
                              waited_for=self.starved_for)
                self.starved_for = None
            return
        head = self.waiting[0] if self.waiting else None
        if head is None or head.min_version <= self.engine.newest_version:
            self._gated_since = None
            return
        if self._gated_since is None:
            self._gated_since = now
        elif now - self._gated_since >= self.cfg.weights_wait_s:
            self.starved_for, self._gated_since = head.min_version, None
            self.log.warning("weights_starved", waited_s=round(self.cfg.weights_wait_s, 3),
                             needs=head.min_version, holds=self.engine.newest_version,
                             leases=len(self.waiting), hint="its leases go back to the broker; no slots "
                             "offered until that version loads")

    def _send_finished(self, fin: m.Finished, peer=None) -> None:
        self.unacked_seq.append((peer or self.peer).send(fin))
        self.unacked.append(fin)

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        idle_wait = self.cfg.link.heartbeat_interval_s / 4
        busy = self.busy = BusyClock(time.monotonic())
        stats_due = time.monotonic() + self.cfg.stats_interval_s
        while not stop:
            if not self.engine.active():
                self._wait(idle_wait)
            msg = self.peer.poll(0.0)
            while msg is not None:
                self.handle(msg)
                msg = self.peer.poll(0.0)
            self.weights.poll(0.0)  # a new version loads here, between decode steps
            self._check_starved(time.monotonic())
            if self.offered() != self.capacity:  # a server engine lost or regained a server; starved or fed
                self._capacity_changed()
            self._start_waiting()
            t_step = time.monotonic()
            outs = self.engine.step()
            if self.cfg.log_leases:
                self._share_step(time.monotonic() - t_step)
            for out in outs:
                self._progress(out)
            self._flush_chunks()
            now = time.monotonic()
            busy.tick(now, self.engine.active())
            if now >= stats_due:
                stats_due = now + self.cfg.stats_interval_s
                self._log_busy(busy)
        self._log_busy(busy)
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
        self.weights.close()
        self.engine.close()
        self.log.info("stopped", leases=len(self.work), version=self.engine.policy_version)

    def _wait(self, timeout_s: float) -> None:
        """Idle: sleep until the broker or the weights link has something (a lease, an announce, a
        version received), at most ``timeout_s``. Waiting on the broker alone left a new version
        unnoticed until the wait ran out, twice a version (its announce, then its receipt): up to
        a quarter of a second of every sync step on the development machine."""
        wait_any([self.peer.sock, *self.weights.waitables()], timeout_s)

    def scrape(self, out) -> None:
        """``/metrics`` (``april_async.telemetry``): tokens, how busy the engine is, the versions."""
        out.counter("april_generator_tokens_total", "Tokens the engine generated", self.tokens_generated)
        out.counter("april_generator_mixed_tokens_total", "Of those, tokens generated after an in-flight "
                    "weight update within their lease", self.mixed_tokens)
        out.gauge("april_generator_policy_version", "The policy version the engine serves",
                  self.engine.policy_version)
        out.gauge("april_generator_slots", "Sequences the engine decodes at once", self.engine.slots)
        out.gauge("april_generator_leases", "Leases held", len(self.work))
        out.counter("april_generator_sessions_total", "Sessions opened with the broker", self.sessions)
        busy = self.busy
        if busy is not None:
            up = busy.at - busy.since
            out.gauge("april_generator_active_sequences", "Sequences active at the loop's last turn",
                      busy.active)
            out.counter("april_generator_busy_seconds_total", "Seconds with at least one sequence active",
                        busy.busy_s)
            out.counter("april_generator_slot_seconds_total", "Active sequences x seconds", busy.slot_s)
            out.counter("april_generator_up_seconds_total", "Seconds the loop has run", up)
            out.gauge("april_generator_busy_ratio", "Share of the loop's time with a sequence active, "
                      "since it started", busy.busy_s / up if up > 0 else None)

    def _log_busy(self, busy: BusyClock) -> None:
        self.log.info("busy", busy_s=round(busy.busy_s, 3), slot_s=round(busy.slot_s, 3), slots=self.engine.slots,
                      up_s=round(busy.at - busy.since, 3), tokens=self.tokens_generated,
                      mixed_tokens=self.mixed_tokens, t=round(time.time(), 3), **self.engine.counters())

    def handle(self, msg) -> None:
        self.broker_proto = msg.proto_version
        body = msg.body
        if isinstance(body, m.Generate):
            if not self.gated:  # an engine with no weights (the scripted test engine) has none to wait for
                self.engine.policy_version = max(self.engine.policy_version, body.min_policy_version)
            sp = body.sampling
            self.waiting.append(EngineRequest(
                lease_id=body.lease_id, sample_id=body.sample_id, prompt=body.prompt.tolist(), resume=body.resume.tolist(),
                max_new_tokens=body.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                stop_token_ids=tuple(sp.stop_token_ids), seed=sp.seed,
                min_version=body.min_policy_version if self.gated else 0))
            self.work[body.lease_id] = LeaseWork(body.lease_id, body.sample_id, len(body.resume),
                                                 group_id=body.group_id)
        elif isinstance(body, m.Abort):
            if body.all and self.engine.caps.batched_abort:
                self._abort_all()
            for lid in list(self.work) if body.all else body.lease_ids:
                self._abort(lid)
        elif isinstance(body, m.Heartbeat):
            if body.ack_seq is not None:
                keep = [i for i, seq in enumerate(self.unacked_seq) if seq > body.ack_seq]
                self.unacked = [self.unacked[i] for i in keep]
                self.unacked_seq = [self.unacked_seq[i] for i in keep]
        elif isinstance(body, m.WeightsPublished):
            self.weights.published(body)  # a version notice only when no broadcaster is the source
        elif isinstance(body, m.Error):
            self.log.warning("broker_error", code=body.code, message=body.message, field=body.field)

    def _start_waiting(self) -> None:
        """Start waiting leases while slots are free, in order; a lease that needs newer weights
        than any the engine can start it on (``newest_version``) waits for them (and so does every
        lease behind it)."""
        while self.waiting and self.engine.active() < self.engine.slots:
            req = self.waiting[0]
            if req.min_version > self.engine.newest_version:
                if self._held_back != req.lease_id:  # once per lease: what a stalled run shows first
                    self._held_back = req.lease_id
                    self.log.info("lease_waits_for_weights", lease=req.lease_id, min_version=req.min_version,
                                  engine_version=self.engine.newest_version, waiting=len(self.waiting))
                return
            self.waiting.popleft()
            if req.lease_id in self.work:  # not aborted while it waited
                try:
                    self.engine.submit(req)
                except RequestRefused as e:  # never runnable here: the broker retires its group
                    self._progress(EngineOutput(req.lease_id, finish="error", error=str(e)))

    def _abort_all(self) -> None:
        """Every started lease at once, with one call per server (a server engine's ``abort_all``);
        their ends come through ``step``."""
        started = [lid for lid in self.work if lid not in self.aborting
                   and not any(r.lease_id == lid for r in self.waiting)]
        self.engine.abort_all()
        self.aborting.update(started)

    def _abort(self, lease_id: int) -> None:
        w = self.work.get(lease_id)
        if w is None or lease_id in self.aborting:
            return
        if any(r.lease_id == lease_id for r in self.waiting):  # never started: nothing to stop
            self.waiting = deque(r for r in self.waiting if r.lease_id != lease_id)
            self._finish(w, "abort")
            return
        out = self.engine.abort(lease_id)
        if out is None:  # a server engine: its last tokens and the end come through step()
            self.aborting.add(lease_id)
        else:
            self._progress(out)

    def _progress(self, out: EngineOutput) -> None:
        w = self.work.get(out.lease_id)
        if w is None:
            return
        self.tokens_generated += len(out.tokens)
        if self.engine.on_swap == "keep":  # a recomputing engine's tokens are each one version's alone
            self.mixed_tokens += w.mixed(out.versions)
        w.tokens += out.tokens
        w.logprobs += out.logprobs
        w.versions += out.versions
        if out.finish:
            self.aborting.discard(out.lease_id)
            self._finish(w, out.finish, out.error)

    def _flush_chunks(self) -> None:
        """Report new tokens: in ``progress`` messages to a broker of 1.7 or later, else as
        ``token_chunk``s. With ``progress`` on, tokens wait until the broker of this session has
        spoken (its version decides the message)."""
        if self.cfg.progress:
            if self.broker_proto is None:
                return
            if parse(self.broker_proto) >= PROGRESS_SINCE:
                self._flush_progress()
                return
        for w in self.work.values():
            if len(w.tokens) - w.sent >= self.cfg.chunk_tokens or (w.sent == 0 and w.tokens and self.sessions > 1):
                self._send_chunk(w)
        self.resend = False

    def _flush_progress(self) -> None:
        """Send every lease's new tokens, in ``progress`` messages of at most ``progress_max_tokens``
        tokens, once the oldest has waited ``progress_interval_s``, once that many wait, or at once
        after a reconnect."""
        waiting = 0
        for w in self.work.values():
            waiting += len(w.tokens) - w.sent
        now = time.monotonic()
        if not waiting:
            self.flush_due = None
            return
        if self.flush_due is None:
            self.flush_due = now + self.cfg.progress_interval_s
        if now < self.flush_due and waiting < self.cfg.progress_max_tokens and not self.resend:
            return
        limit = self.cfg.progress_max_tokens
        entries: list[m.ProgressEntry] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        for w in self.work.values():
            while w.sent < len(w.tokens):
                a = w.sent
                b = min(len(w.tokens), a + limit - len(tokens))
                entries.append(m.ProgressEntry(w.lease_id, w.sample_id, w.start + a, b - a,
                                               spans_of(w.versions[a:b])))
                tokens += w.tokens[a:b]
                logprobs += w.logprobs[a:b]
                w.sent = b
                if len(tokens) == limit:
                    self._send_progress(entries, tokens, logprobs)
                    entries, tokens, logprobs = [], [], []
        if entries:
            self._send_progress(entries, tokens, logprobs)
        self.flush_due, self.resend = None, False

    def _send_progress(self, entries: list[m.ProgressEntry], tokens: list[int], logprobs: list[float]
                       ) -> None:
        self.peer.send(m.Progress(entries=entries, tokens=np.asarray(tokens, dtype=np.int32),
                                  logprobs=np.asarray(logprobs, dtype=np.float32)))

    def _pending(self, w: LeaseWork):
        s = slice(w.sent, None)
        return (w.start + w.sent, np.asarray(w.tokens[s], dtype=np.int32),
                np.asarray(w.logprobs[s], dtype=np.float32), spans_of(w.versions[s]))

    def _send_chunk(self, w: LeaseWork) -> None:
        offset, toks, lps, spans = self._pending(w)
        self.peer.send(m.TokenChunk(lease_id=w.lease_id, sample_id=w.sample_id, offset=offset, versions=spans,
                                    tokens=toks, logprobs=lps))
        w.sent = len(w.tokens)

    def _share_step(self, seconds: float) -> None:
        """``log_leases``: an engine step's seconds, shared equally among the leases it ran."""
        waiting = {r.lease_id for r in self.waiting}
        running = [w for lid, w in self.work.items() if lid not in waiting]
        for w in running:
            w.decode_s += seconds / len(running)

    def _finish(self, w: LeaseWork, reason: str, error: str | None = None) -> None:
        if reason == "error":
            self._check_broker_takes_errors(w, error)
            self.log.warning("lease_refused", lease=w.lease_id, sample=w.sample_id, tokens=len(w.tokens), error=error)
            error = error or "refused by the engine"
        else:
            error = None
        offset, toks, lps, spans = self._pending(w)
        self._send_finished(m.Finished(lease_id=w.lease_id, sample_id=w.sample_id, offset=offset, versions=spans,
                                       tokens=toks, logprobs=lps, reason=reason, error=error))
        if self.cfg.log_leases:
            self.log.info("lease_done", lease=w.lease_id, sample=w.sample_id, group=w.group_id, reason=reason,
                          tokens=len(w.tokens), decode_s=round(w.decode_s, 6), t=round(time.time(), 3))
        del self.work[w.lease_id]

    def _check_broker_takes_errors(self, w: LeaseWork, error: str | None) -> None:
        """A broker older than protocol 1.5 knows no ``finished.reason = "error"``."""
        if self.broker_proto is not None and parse(self.broker_proto) < ERROR_REASON_SINCE:
            raise ActorFailed(f"the engine refused sample {w.sample_id} ({error}), and the broker speaks protocol "
                              f"{self.broker_proto}, which cannot take a refusal (finished.reason \"error\" needs "
                              f"{'.'.join(map(str, ERROR_REASON_SINCE))}): upgrade the broker")

