"""The broadcaster's round logic as a pure planner: sessions, epochs, acks, benching, publishing.

``RoundPlanner`` holds what the broadcaster knows (who has a session and which version each
generator holds, the held version's layout, the round in progress) and decides what happens
next. It does no I/O, starts no thread, imports no torch and reads no clock: every method takes
``now`` (seconds on the caller's clock) and returns a list of effects, small dataclasses that
the actor carries out in order (send a message, start the collective, tell the broker, log).
The weights' bytes stay with the actor; the planner knows only a version's size, layout and
bucket digests (protocol 1.6), which the actor computes off its loop when told to (``Hash``)
and hands over with ``digested``: a round of a version starts only once its digests are known,
so that every announce carries them. The hash is BLAKE3-128 when every generator the round sends
the bytes to said hello with protocol 1.7 or later, else BLAKE2b-128, which every member since
1.6 checks (``digest_alg``); a held version hashed with the other one is hashed again before its
round starts (a 1.6 generator joined, or the last one left).

The inputs, one method each: ``hello``, ``touch`` (any message from a session), ``update`` (a
learner's ``weights_update``), ``heartbeat`` (a generator's ack or nack, its ``policy_version``),
``bye``, ``expired`` (the hub heard nothing from a peer for ``peer_timeout_s``),
``digested`` (the held version's bucket digests, under the algorithm asked for),
``collective_finished`` (the worker thread's result or error) and ``tick``.

The rules, as the actor's docstring describes them: a round starts when some generator heard
from in the last ``peer_timeout_s / 2`` holds an older version than the one held; it re-forms
the group (a new epoch) when its receivers differ from the last group's or the last round lost
someone; it waits for each member's answer up to ``timeout_s`` after the collective ends;
members that neither acked nor failed by then are forgotten and benched for ``2 × timeout_s``;
after a round that lost someone the next starts no earlier than ``peer_timeout_s / 2`` later.
A member found gone (silent, ``bye``) while the collective still runs, and before it acked, is
not waited for: the actor cuts the collective (``Sever``), which then fails for every member at
once, and the next round re-forms without it (issue 29: a 25 s network cut held the round, every
member and the learner for the whole cut). A member that misses ``report_failing_after`` rounds
in a row is benched, for longer each time (``_streaks``).
A member whose process ended (``bye``, silence, or a hello under its name from a new process:
another ``incarnation``, protocol 1.8) is no longer a rank of the group: the next round re-forms
it (a new epoch), and a round it was in stops waiting for it, cut if its collective still runs
(issue 42: a generator killed and restarted within the peer timeout kept its dead predecessor's
rank, and the next round waited on it). Such a round fails the others by no fault of theirs: it
counts in no survivor's streak, benches no late survivor, and the next round starts at once.
A member that says hello again mid-round is answered for at once by what its hello says it
holds, or, while the collective still runs, sent its announce again. A member on SGLang servers
is sent a ``heartbeat`` naming the version as soon as its servers took it: that heartbeat is its
generator's notice of the version (``weights.link``).

A held version may be a LoRA adapter (protocol 1.10, ``HeldVersion.adapter``): every announce of it
says so. Its rounds leave out the generators that cannot take one (``_cannot_take``): those whose
hello said a protocol older than 1.10 (they would load the adapter's tensors as full weights and
fail on names they do not know). Such a generator is warned about once per version, neither waited
for nor blamed, and the version is published once every other generator holds it; it takes part
again in the next full-weight version's round. SGLang members are in its rounds as in any: their
push loads the adapter through SGLang's LoRA routes (``broadcaster.sglang``), and a server that
cannot take it (started without ``--enable-lora``) fails the round for its member as a failed push.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from april_async.broadcaster.config import BroadcasterConfig
from april_async.telemetry import Histogram
from april_async.wire import messages as m

ROLES = ("learner", "generator")
BLAKE3_SINCE = (1, 7)
"""The protocol version since which a member checks digests of ``digest_alg`` ``blake3-128``."""
SGLANG_NO_ADAPTER = ("the SGLang server was started without --enable-lora (and --max-lora-rank, "
                     "--lora-target-modules): adapter versions reach SGLang only through its LoRA routes")
"""Why an SGLang member cannot take an adapter version (its push fails: ``broadcaster.sglang``)."""


# ---------------------------------------------------------------------------------------------
# Effects


@dataclass(frozen=True)
class Send:
    """Send ``body`` to the session ``name`` (``reply``: as the answer to the message in hand)."""

    name: str
    body: m.Body
    reply: bool = False


@dataclass(frozen=True)
class Reply:
    """Answer the message in hand on the connection it came from (its sender has no session)."""

    body: m.Body


@dataclass(frozen=True)
class Open:
    """The connection of the message in hand (a hello) is now the session ``name``."""

    name: str


@dataclass(frozen=True)
class Forget:
    """The session ``name`` is over: its next message is refused until it says hello again."""

    name: str
    reason: str


@dataclass(frozen=True)
class Keep:
    """The ``weights_update`` in hand is now the held version: keep its bytes."""

    version: int


@dataclass(frozen=True)
class Hash:
    """Compute the bucket digests of the held ``version`` under ``digest_alg``, off the loop, then
    feed ``digested``; a digest job still running for an older request is no longer wanted."""

    version: int
    digest_alg: str


@dataclass(frozen=True)
class StartCollective:
    """Run the round's collective on the worker thread, then feed ``collective_finished``.

    ``root`` is this process's place in the group (None: no member receives over the group);
    ``rejoin``: form the group of ``root.epoch`` first; ``servers``: the SGLang members and their
    servers, pushed to after the broadcast."""

    version: int
    root: m.GroupSpec | None
    rejoin: bool
    servers: dict[str, list[str]]
    bucket_bytes: int


@dataclass(frozen=True)
class Sever:
    """A member of the running round is gone (``member``, ``reason``): cut the group's connections
    and give up a rendezvous being formed, so that the collective fails now rather than after
    ``timeout_s`` (``WeightGroup.sever``); the next round re-forms without it."""

    member: str
    reason: str


@dataclass(frozen=True)
class Publish:
    """Tell the broker that ``version`` is out (``weights_published``)."""

    version: int
    num_bytes: int


@dataclass(frozen=True)
class Log:
    level: str  # debug | info | warning
    event: str
    fields: dict


def _log(level: str, event: str, **fields) -> Log:
    return Log(level, event, fields)


@dataclass(frozen=True)
class StatusChanged:
    """Something the status file shows has changed."""


Effect = Send | Reply | Open | Forget | Keep | Hash | StartCollective | Sever | Publish | Log | StatusChanged


# ---------------------------------------------------------------------------------------------
# Inputs and state


@dataclass(frozen=True)
class CollectiveResult:
    """What the worker thread reports: the seconds of the join and of the broadcast, the
    broadcast's failure (None: fine), and each SGLang member's failure (None: its servers hold
    the version)."""

    join_s: float
    bcast_s: float
    failed: str | None
    pushed: dict[str, str | None] = field(default_factory=dict)


@dataclass
class Session:
    role: str
    version: int = -1  # a generator's held policy version (-1: none)
    joined: float = 0.0
    heard: float = 0.0  # last message from it
    servers: tuple[str, ...] = ()  # a generator on SGLang servers: their URLs (it receives nothing itself)
    proto: tuple[int, int] | None = None  # the protocol version of its hello (None: not stated)
    incarnation: str = ""  # the process behind the session (protocol 1.8; "": not stated)


@dataclass(frozen=True)
class HeldVersion:
    """The newest version handed over: its layout and size (the bytes stay with the actor)."""

    version: int
    tensors: list[m.TensorSpec]
    num_bytes: int
    learner: str
    digests: tuple[str, ...] | None = ()  # one per bucket, in order; None: being computed
    digest_alg: str = m.BLAKE2B_128  # what ``digests`` are (or are being computed) under
    adapter: m.AdapterSpec | None = None  # since 1.10: the version is this LoRA adapter (None: full weights)


@dataclass
class Round:
    version: int
    epoch: int
    members: tuple[str, ...]
    num_bytes: int
    rejoin: bool
    started: float
    servers: dict[str, list[str]] = field(default_factory=dict)  # SGLang members and their servers
    collective_end: float | None = None
    timings: tuple[float, float] = (0.0, 0.0)  # (join, broadcast) seconds
    failed: str | None = None
    acked: set[str] = field(default_factory=set)
    nacked: set[str] = field(default_factory=set)
    announces: dict[str, m.WeightsAnnounce] = field(default_factory=dict)  # what each group member was sent
    admission_checked: bool = False  # whether its rendezvous was looked at (``absent``)
    dead: set[str] = field(default_factory=set)
    """Members whose process ended during the round (a ``bye``, silence, or a new process under the
    name): the round waits for none of them, and the others are not blamed for what that cost."""

    @property
    def running(self) -> bool:
        """The collective has not reported back yet."""
        return self.collective_end is None


# ---------------------------------------------------------------------------------------------
# The planner


class RoundPlanner:
    """Sessions and rounds of one broadcaster process; see the module docstring.

    ``backend`` is the group's resolved backend, ``store`` the TCPStore's ``host:port``,
    ``epoch_id`` this process's identity in every ``welcome`` (new at each start), and
    ``key_prefix`` the secret every ``GroupSpec`` carries (protocol 1.6; the actor draws one per
    process, and it reaches members only inside announces), ``rendezvous`` the endpoint of the
    rendezvous store every ``GroupSpec`` names ("": members meet on the TCPStore)."""

    def __init__(self, cfg: BroadcasterConfig, *, backend: str, store: str, epoch_id: str,
                 key_prefix: str = "", rendezvous: str = ""):
        self.cfg = cfg
        self.backend = backend
        self.store = store
        self.epoch_id = epoch_id
        self.key_prefix = key_prefix
        self.rendezvous = rendezvous
        self.timeout_s = cfg.timeout_s
        self.fresh_s = cfg.link.peer_timeout_s / 2  # a member must have spoken this recently
        self.sessions: dict[str, Session] = {}
        self.benched: dict[str, float] = {}  # generator -> time until which rounds leave it out
        self.held: HeldVersion | None = None
        self.published = -1
        self.epoch = 0
        self.group_members: tuple[str, ...] = ()
        self.group_ok = False
        self.round: Round | None = None
        self.retry_at = 0.0
        self.rounds = 0
        self.failed_rounds = 0
        self.bytes_broadcast = 0  # the versions' bytes of rounds some member acknowledged
        self.round_seconds = Histogram()  # each round, from its start to its end (/metrics)
        self.last_round: dict = {}  # the last round's log fields
        self.failing: dict[str, int] = {}  # generator -> rounds in a row it was in and did not receive
        self.absences: dict[str, int] = {}  # generator -> rendezvous in a row it did not reach in time
        self.admit_s = cfg.link.peer_timeout_s
        """How long after a round re-forming the group starts every member must have reached its
        rendezvous (registered its key): one that has not is given up on (``absent``)."""
        self.left_out: set[tuple[str, int]] = set()
        """``(generator, version)``: told (logged) that the held adapter version is not sent to it."""

    @property
    def held_version(self) -> int | None:
        return self.held.version if self.held is not None else None

    # ------------------------------------------------------------------ messages

    def hello(self, name: str, role: str, version: int | None, servers: list[str] | tuple[str, ...],
              now: float, proto: tuple[int, int] | None = None, incarnation: str = "") -> list[Effect]:
        """A learner or generator opens (or re-opens) its session; a generator's ``version`` is
        the one it holds, ``proto`` the protocol version its hello's envelope states
        (``wire.version.parse``; None: unknown, taken as too old for anything since 1.6),
        ``incarnation`` the process saying it (protocol 1.8; "": not stated, taken as the process
        the session had). A hello from another process than the session's ends the old one's
        membership at once (``_restarted``)."""
        if role not in ROLES:
            return [Reply(m.Error(code="refused",
                                  message=f"the broadcaster takes learners and generators, not {role!r}"))]
        held = -1 if version is None else version
        old = self.sessions.get(name)
        restarted = (old is not None and bool(old.incarnation and incarnation)
                     and old.incarnation != incarnation)
        self.sessions[name] = Session(role, held, joined=old.joined if old else now, heard=now,
                                      servers=tuple(servers) if role == "generator" else (), proto=proto,
                                      incarnation=incarnation or (old.incarnation if old else ""))
        link = self.cfg.link
        welcome = m.Welcome(broker_epoch=self.epoch_id,
                            policy_version=self.held.version if self.held else max(self.published, 0),
                            heartbeat_interval_s=link.heartbeat_interval_s,
                            peer_timeout_s=link.peer_timeout_s, max_message_bytes=self.cfg.max_update_bytes)
        out: list[Effect] = [Open(name), Send(name, welcome, reply=True), StatusChanged(),
                             _log("info", "hello", peer=name, role=role, version=version)]
        if restarted:
            out += self._restarted(name, old)
        r = self.round
        if (role == "generator" and r is not None and name in r.members and name not in r.servers
                and name not in r.dead):
            out += self._member_hello(r, name, held)
        return out

    def _restarted(self, name: str, old: Session) -> list[Effect]:
        """``name`` said hello from a new process: the old one is dead (issue 42: a generator killed
        and started again within the peer timeout kept its dead predecessor's rank in the group,
        the next round waited on it for the whole collective timeout, and then benched both
        members). Its rank in the group is given up (the next round re-forms), the round in
        flight stops waiting for it (cut, if its collective still runs), and the new process
        starts with a clean record: no bench, no streak of its predecessor's."""
        event = "member_restarted" if old.role == "generator" else "peer_restarted"
        out: list[Effect] = [_log("warning", event, peer=name, role=old.role, was=old.incarnation,
                                  incarnation=self.sessions[name].incarnation)]
        if old.role != "generator":
            return out
        for record in (self.benched, self.failing, self.absences):
            record.pop(name, None)
        out += self._member_ended(name, "restarted")
        return out

    def _member_ended(self, name: str, reason: str) -> list[Effect]:
        """The process of generator ``name`` is gone: the group it was a rank of is no longer whole
        (the next round re-forms it), and a round it is in waits for it no longer; if that round's
        collective still runs and it has not received, the collective is cut."""
        if name in self.group_members:
            self.group_ok = False
        r = self.round
        if r is None or name not in r.members or name in r.dead:
            return []
        r.dead.add(name)
        if r.running and name not in r.servers and name not in r.acked:
            # The collective would wait out timeout_s for it, and every other member and the learner with it.
            return [Sever(name, reason),
                    _log("warning", "round_abandoned", member=name, reason=reason, version=r.version,
                         epoch=r.epoch, hint="the collective is cut now; the next round re-forms without it")]
        return []

    def _member_hello(self, r: Round, name: str, version: int) -> list[Effect]:
        """A member opened a new session mid-round (it thought this process dead, say, while it
        was stopped): what went down its old connection may be lost, its ack or its announce.
        Its hello says what it holds. Holding the version: acked. Else, while the collective
        still runs, it gets its announce again (a member acts on each epoch and version once, so
        a copy that did arrive is ignored); after the collective, the round failed for it.
        Nobody waits for it until the round's timeout, nor benches it. (An SGLang member is
        answered for by its servers' push, not by its session.)"""
        if version < r.version and r.running and name in r.announces:
            return [Send(name, r.announces[name]),
                    _log("info", "announce_resent", peer=name, version=r.version, epoch=r.epoch)]
        return self._ack(name, version)

    def touch(self, name: str, now: float) -> bool:
        """Any message from ``name``: False when it has no session (the message is refused)."""
        s = self.sessions.get(name)
        if s is None:
            return False
        s.heard = now
        return True

    def update(self, name: str, version: int, tensors: list[m.TensorSpec], num_bytes: int,
               layout_error: str | None, now: float, digests: list[str] | tuple[str, ...] | None = (),
               digest_alg: str = m.BLAKE2B_128, adapter: m.AdapterSpec | None = None) -> list[Effect]:
        """A ``weights_update`` from the session ``name``: held when it comes from a learner, is
        newer than the held version and its layout fits (``layout_error`` says why not).
        ``digests``: its bucket digests under ``digest_alg``, or None when the actor is to compute
        them (``Hash`` follows ``Keep``, under the algorithm a round starting now would use, and
        rounds of the version wait for ``digested``). ``adapter``: the version is that LoRA adapter
        (protocol 1.10), kept with it and named in every announce of it."""
        s = self.sessions.get(name)
        if s is None:
            return []
        if s.role != "learner":
            why = f"weights_update comes from learners, not a {s.role}"
            return [Send(name, m.Error(code="refused", message=why), reply=True)]
        if self.held is not None and version <= self.held.version:
            return [_log("info", "update_ignored", version=version, held=self.held.version)]
        if layout_error is not None:
            why = f"weights_update {version}: {layout_error}"[:500]
            return [_log("warning", "update_refused", version=version, error=layout_error),
                    Send(name, m.Error(code="refused", message=why, field="tensors"), reply=True)]
        if digests is None:
            digest_alg = self.digest_alg(now, adapter=adapter is not None)
        self.held = HeldVersion(version, list(tensors), num_bytes, name,
                                None if digests is None else tuple(digests), digest_alg, adapter)
        self.left_out.clear()  # about older versions, which never come back
        return [Keep(version), *([Hash(version, digest_alg)] if digests is None else []), StatusChanged(),
                _log("info", "update", version=version, tensors=len(tensors), bytes=num_bytes, learner=name,
                     adapter=adapter is not None)]

    def digested(self, version: int, digests: list[str], now: float,
                 digest_alg: str = m.BLAKE2B_128) -> list[Effect]:
        """The bucket digests of ``version`` under ``digest_alg``, computed by the actor. Ignored
        unless ``version`` is still the one held (a newer one may have replaced it meanwhile) and
        still wants digests under that algorithm (the round's members may have changed it); one
        per bucket of the configured ``bucket_bytes``, else a ``ValueError`` naming both counts (a
        bug)."""
        held = self.held
        if (held is None or held.version != version or held.digests is not None
                or held.digest_alg != digest_alg):
            return []
        count = -(-held.num_bytes // self.cfg.bucket_bytes)
        if len(digests) != count:
            raise ValueError(f"{len(digests)} digests for version {version}, which has {count} buckets of "
                             f"{self.cfg.bucket_bytes} bytes")
        self.held = replace(held, digests=tuple(digests))
        return [_log("debug", "digested", version=version, buckets=count, digest_alg=digest_alg)]

    def digest_alg(self, now: float, adapter: bool = False) -> str:
        """The hash of the digests a round starting now would announce (``_digest_alg``), of an
        adapter version when ``adapter`` (whose rounds leave some generators out)."""
        return self._digest_alg(tuple(g for g in self._members(now, adapter) if not self.sessions[g].servers))

    def _digest_alg(self, receivers: tuple[str, ...]) -> str:
        """BLAKE3-128 when there are ``receivers`` (generators receiving over the group) and every
        one said hello with protocol ``BLAKE3_SINCE`` or later, else BLAKE2b-128, which every
        member since 1.6 checks."""
        protos = [self.sessions[g].proto for g in receivers]
        if protos and all(p is not None and p >= BLAKE3_SINCE for p in protos):
            return m.BLAKE3_128
        return m.BLAKE2B_128

    def heartbeat(self, name: str, policy_version: int | None, now: float) -> list[Effect]:
        """A heartbeat from a session; a generator's ``policy_version`` acks (or fails) a round."""
        s = self.sessions.get(name)
        if s is None or policy_version is None or s.role != "generator":
            return []
        return self._ack(name, policy_version)

    def bye(self, name: str, reason: str, now: float) -> list[Effect]:
        return self._forget(name, reason or "bye")

    def expired(self, name: str, now: float) -> list[Effect]:
        """The hub heard nothing from ``name`` for ``peer_timeout_s``."""
        return self._forget(name, "silent")

    def _ack(self, name: str, version: int) -> list[Effect]:
        s = self.sessions[name]
        s.version = version
        r = self.round
        if (r is not None and name in r.members and name not in r.acked and name not in r.nacked
                and name not in r.dead):
            if version >= r.version:
                r.acked.add(name)
            else:  # the member's receive failed: it left the group and waits for the next round
                r.nacked.add(name)
        return [StatusChanged()]

    def _forget(self, name: str, reason: str) -> list[Effect]:
        s = self.sessions.pop(name, None)
        if s is None:
            return []
        out: list[Effect] = [Forget(name, reason), StatusChanged(), _log("info", "peer_gone", peer=name, reason=reason)]
        if s.role == "generator":  # gone (a cut, a crash, a bye): the group is broken, no round waits for it
            out += self._member_ended(name, reason)
        return out

    # ------------------------------------------------------------------ the collective

    def collective_finished(self, now: float, result: CollectiveResult | None = None,
                            error: str | None = None) -> list[Effect]:
        """The worker thread is done: its ``result``, or the ``error`` it raised (a bug, not a
        failed collective: every member counts as failed). The round ends on the next ``tick``
        once every member still present has answered, or ``timeout_s`` from now."""
        r = self.round
        if r is None or not r.running:
            return []
        r.collective_end = now
        if result is None:
            r.failed = error or "the collective ended without a result"
            r.nacked.update(r.servers)
            return [StatusChanged()]
        r.timings = (result.join_s, result.bcast_s)
        r.failed = result.failed
        out: list[Effect] = [StatusChanged()]
        for name, why in result.pushed.items():  # SGLang members answer through the push itself
            if why is None and name in self.sessions:
                self.sessions[name].version = r.version
                # Its servers hold the version now: told at once (the generator reads their versions
                # then), rather than by the next heartbeat, since this is where its versions come from.
                out.append(Send(name, m.Heartbeat(policy_version=r.version)))
            (r.acked if why is None else r.nacked).add(name)
        return out

    # ------------------------------------------------------------------ admission

    def admission_due(self, now: float) -> bool:
        """Whether the running round's rendezvous is to be looked at now (``absent``): it re-forms
        the group, its collective has not reported, ``admit_s`` have passed, and not looked at yet."""
        r = self.round
        return (r is not None and r.running and r.rejoin and not r.admission_checked
                and now - r.started >= self.admit_s)

    def rendezvous_spec(self) -> m.GroupSpec:
        """Rank 0's spec of the running round's epoch (what ``WeightGroup.arrived`` looks under)."""
        r = self.round
        return self._spec(0, len([g for g in r.members if g not in r.servers]) + 1)

    def absent(self, arrived: set[int] | None, now: float) -> list[Effect]:
        """The running round's rendezvous ``admit_s`` after it started: ``arrived``, the ranks whose
        key is in (None: it cannot be told). A member not there by then (a worker still stuck in an
        old collective, say, after a network cut) is not waited for: it is benched, for
        ``peer_timeout_s / 2`` doubled at each absence in a row (up to ``2 × timeout_s``), and the
        epoch is given up (``Sever``), so the others re-form without it at once instead of waiting
        ``timeout_s``. It is admitted again when its bench ends, and only by reaching a rendezvous."""
        r = self.round
        if r is None or not r.running or r.admission_checked:
            return []
        r.admission_checked = True
        if arrived is None:
            return []
        receivers = [g for g in r.members if g not in r.servers]
        missing = [g for rank, g in enumerate(receivers, start=1) if rank not in arrived and g not in r.dead]
        if not missing:
            return []
        out: list[Effect] = []
        for g in missing:
            r.nacked.add(g)  # the round does not wait for its answer either
            k = self.absences[g] = self.absences.get(g, 0) + 1
            wait = self._bench_s(k)
            self.benched[g] = max(self.benched.get(g, 0.0), now + wait)
            out.append(_log("warning", "member_absent", member=g, epoch=r.epoch, version=r.version, absences=k,
                            waited_s=round(now - r.started, 3), benched_s=round(wait, 3),
                            why="not at the group's rendezvous in time"))
        out.append(Sever(missing[0], "absent from the rendezvous"))  # one cut gives the whole epoch up
        return out

    # ------------------------------------------------------------------ tick

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if self.round is not None:
            out += self._progress(self.round, now)
        if self.round is None and now >= self.retry_at:
            out += self._tell_left_out(now)
            out += self._maybe_start(now)
        return out

    def _cannot_take(self, name: str, adapter: bool) -> str | None:
        """Why generator ``name`` is left out of the rounds of the held version (None: it is not):
        an adapter version (``adapter``) goes to no generator whose hello said a protocol older than
        1.10. SGLang members take it (their push loads it as a LoRA adapter on their servers)."""
        if not adapter:
            return None
        s = self.sessions[name]
        if s.servers:
            return None
        if s.proto is None or s.proto < m.ADAPTER_SINCE:
            said = "stated no protocol" if s.proto is None else f"said protocol {s.proto[0]}.{s.proto[1]}"
            since = ".".join(map(str, m.ADAPTER_SINCE))
            return (f"its hello {said}; an adapter version needs {since} or later (an older generator would "
                    f"load the adapter's tensors as full weights)")
        return None

    def _tell_left_out(self, now: float) -> list[Effect]:
        """Warn, once per generator and version, that the held adapter version is not sent to a
        generator that needs it but cannot take it."""
        held = self.held
        if held is None or held.adapter is None:
            return []
        out: list[Effect] = []
        for g in self._generators(now):
            why = self._cannot_take(g, True)
            if why is None or self.sessions[g].version >= held.version or (g, held.version) in self.left_out:
                continue
            self.left_out.add((g, held.version))
            out.append(_log("warning", "adapter_not_announced", member=g, version=held.version, why=why,
                            base_digest=held.adapter.base_digest))
        return out

    def _maybe_start(self, now: float) -> list[Effect]:
        held = self.held
        if held is None:
            return []
        adapter = held.adapter is not None
        gens = self._generators(now, adapter)
        if not any(self.sessions[g].version < held.version for g in gens):
            if held.version > self.published:  # no generator, or all hold it already
                return self._publish(held.version, held.num_bytes, members=len(gens))
            return []
        members = self._members(now, adapter)
        if not any(self.sessions[g].version < held.version for g in members):
            return []  # those that need it are quiet: wait until they speak again or expire
        servers = {g: list(self.sessions[g].servers) for g in members if self.sessions[g].servers}
        receivers = tuple(g for g in members if g not in servers)  # members of the torch.distributed group
        if receivers and (alg := self._digest_alg(receivers)) != held.digest_alg:
            self.held = replace(held, digests=None, digest_alg=alg)
            return [Hash(held.version, alg),
                    _log("info", "rehash", version=held.version, digest_alg=alg, was=held.digest_alg,
                         members=list(receivers))]
        if receivers and held.digests is None:
            return []  # the actor is still hashing it: every announce carries the digests
        rejoin = bool(receivers) and (receivers != self.group_members or not self.group_ok)
        if rejoin:
            self.epoch += 1
            self.group_members, self.group_ok = receivers, True
        world = len(receivers) + 1
        out: list[Effect] = []
        announces = {}
        for rank, name in enumerate(receivers, start=1):
            announces[name] = m.WeightsAnnounce(
                version=held.version, tensors=held.tensors, num_bytes=held.num_bytes,
                bucket_bytes=self.cfg.bucket_bytes, group=self._spec(rank, world), digests=list(held.digests),
                digest_alg=held.digest_alg, adapter=held.adapter)
            out.append(Send(name, announces[name]))
        root = self._spec(0, world) if receivers else None
        out.append(StartCollective(held.version, root, rejoin, servers, self.cfg.bucket_bytes))
        self.round = Round(held.version, self.epoch, members, held.num_bytes, rejoin, now, servers=servers,
                           announces=announces)
        out.append(StatusChanged())
        out.append(_log("debug", "round_started", version=held.version, epoch=self.epoch,
                        members=list(members), rejoin=rejoin, sglang=sorted(servers), adapter=adapter))
        return out

    def _generators(self, now: float, adapter: bool = False) -> list[str]:
        """The generators with a session, not benched, in order of arrival; for an adapter version
        (``adapter``), only those that can take one (``_cannot_take``)."""
        return [name for name, s in sorted(self.sessions.items(), key=lambda kv: kv[1].joined)
                if s.role == "generator" and self.benched.get(name, 0.0) <= now
                and self._cannot_take(name, adapter) is None]

    def _members(self, now: float, adapter: bool = False) -> tuple[str, ...]:
        """The members of a round starting now: the generators heard from lately (a dead one is
        not waited for in a rendezvous), of those that can take an adapter when ``adapter``."""
        return tuple(g for g in self._generators(now, adapter)
                     if now - self.sessions[g].heard <= self.fresh_s)

    def _spec(self, rank: int, world: int) -> m.GroupSpec:
        return m.GroupSpec(epoch=self.epoch, rank=rank, world_size=world, store=self.store,
                           backend=self.backend, timeout_s=self.timeout_s, key_prefix=self.key_prefix,
                           rendezvous=self.rendezvous)

    def _progress(self, r: Round, now: float) -> list[Effect]:
        if r.running:
            return []
        present = {n for n in r.members if n in self.sessions and n not in r.dead}
        pending = present - r.acked - r.nacked
        if pending and now < r.collective_end + self.timeout_s:
            return []
        return self._finish(r, now, late=pending)

    def _finish(self, r: Round, now: float, late: set[str]) -> list[Effect]:
        self.round = None
        self.rounds += 1
        out: list[Effect] = []
        gone = {n for n in r.members if n not in self.sessions or n in r.dead}
        # A round a member died in failed for the others by no fault of theirs: only the members
        # gone for good (not restarted) count it against themselves.
        blameless = self._blameless(gone)
        missed = set(r.members) - r.acked
        excused = {n for n in missed if n in self.sessions} if blameless else set()
        benched = []
        for name in sorted(late):
            # Neither acked nor failed in time: its session ends, so that an answer still on its way
            # is not read as one to the next round. Left out of rounds for a while too, unless a
            # member died in this round: then the wait was the dead one's doing, not its own.
            out += self._forget(name, "no_ack")
            if not blameless:
                self.benched[name] = now + 2 * self.timeout_s
                benched.append(name)
        lost = bool(r.failed or r.nacked or late or gone)
        if lost:
            self.group_ok = False
            self.failed_rounds += 1
            # A member lost for no known reason may be dead without a word yet: wait until it is no
            # longer fresh. Members known to be gone are out of the next round already: at once.
            self.retry_at = now if gone else now + self.fresh_s
        join_s, bcast_s = r.timings
        fields = {"version": r.version, "epoch": r.epoch, "members": len(r.members), "acked": len(r.acked),
                  "bytes": r.num_bytes, "join_s": round(join_s, 3), "bcast_s": round(bcast_s, 3),
                  "gb_s": round(r.num_bytes / bcast_s / 1e9, 3) if bcast_s > 0 and not r.failed else None,
                  "s": round(now - r.started, 3)}
        self.round_seconds.observe(now - r.started)
        self.last_round = fields
        if r.acked:
            self.bytes_broadcast += r.num_bytes
        if lost:
            out.append(_log("warning", "round_incomplete", failed=r.failed, nacked=sorted(r.nacked),
                            late=sorted(late), gone=sorted(gone), benched=benched, **fields))
        else:
            out.append(_log("info", "round", **fields))
        out += self._streaks(r, missed=missed - excused, excused=excused, now=now)
        if r.acked and r.version > self.published:
            out += self._publish(r.version, r.num_bytes, members=len(r.acked))
        out.append(StatusChanged())
        return out

    def _bench_s(self, k: int) -> float:
        """How long a member failing its ``k``-th time in a row (from ``report_failing_after`` on)
        is left out of rounds: ``peer_timeout_s / 2``, doubled each time, at most ``2 × timeout_s``
        (what bounds the wait of the rounds property test's liveness check)."""
        return min(self.fresh_s * 2 ** (k - 1), 2 * self.timeout_s)

    @staticmethod
    def _blameless(gone: set[str]) -> bool:
        """Whether the survivors of a round that lost the members ``gone`` (their process ended)
        are held blameless for it: yes whenever someone died (SPEC, ``weights_announce`` rule 9)."""
        return bool(gone)

    def _streaks(self, r: Round, missed: set[str], now: float,
                 excused: set[str] = frozenset()) -> list[Effect]:
        """Count, per generator, the rounds in a row it took part in without receiving; report a
        streak when it reaches ``report_failing_after`` (and at every multiple), and its end. From
        that many rounds in a row on, the member is benched (left out of rounds) for
        ``peer_timeout_s / 2``, doubled each further round, up to ``2 × timeout_s``: a member that
        keeps failing costs the others a re-formed group ever more rarely. ``excused`` members
        neither received nor missed: their streaks stay as they were."""
        out: list[Effect] = []
        every = self.cfg.report_failing_after
        for name in sorted(set(r.members) - missed - excused):
            self.absences.pop(name, None)
            if self.failing.pop(name, 0) >= every:
                out.append(_log("info", "member_recovered", member=name, version=r.version))
        for name in sorted(missed):
            n = self.failing[name] = self.failing.get(name, 0) + 1
            if n >= every and name in self.sessions:  # failing again: left out of rounds for longer each time
                wait = self._bench_s(n - every + 1)
                self.benched[name] = max(self.benched.get(name, 0.0), now + wait)
                out.append(_log("warning", "member_benched", member=name, rounds=n, for_s=round(wait, 3),
                                version=r.version))
            if n % every == 0:
                why = ("the collective failed" if r.failed else "refused" if name in r.nacked
                       else "left" if name not in self.sessions else "no ack")
                out.append(_log("warning", "member_failing", member=name, rounds=n, version=r.version, why=why,
                                failed=r.failed))
        return out

    def _publish(self, version: int, num_bytes: int, members: int) -> list[Effect]:
        self.published = version
        return [Publish(version, num_bytes), StatusChanged(),
                _log("info", "published", version=version, bytes=num_bytes, generators=members)]

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        return {"version": self.held.version if self.held else -1, "published": self.published,
                "epoch": self.epoch,
                "members": {n: s.version for n, s in self.sessions.items() if s.role == "generator"},
                "rounds": self.rounds, "failed_rounds": self.failed_rounds,
                "round": None if (r := self.round) is None else {
                    "version": r.version, "epoch": r.epoch, "members": list(r.members),
                    "acked": sorted(r.acked), "running": r.running},
                "failing": {n: k for n, k in sorted(self.failing.items()) if k >= self.cfg.report_failing_after}}
