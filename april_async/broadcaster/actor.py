"""The broadcaster actor: holds the newest policy version and fans it out to the generators.

Start:  april broadcaster --config run.toml   (section [broadcaster])

Sessions. Learners and generators open sessions on the broadcaster's own hub with ``hello``
(role ``learner`` or ``generator``; a generator's carries the version it holds). A learner hands
each new version over once (``weights_update``); only the newest is kept, an older or equal one
is ignored. A generator acknowledges each version with ``heartbeat`` ``policy_version``.

A round, top to bottom (``tick``):

    need       some generator holds an older version than the one held;
    group      the generators heard from lately, ranks 1..N in order of arrival; when that list
               differs from the current group's, or the last round failed, a new epoch is formed
               (every member joins it; rank 0 is this process, which hosts the TCPStore);
    announce   ``weights_announce`` to every member: the group, the layout, the sizes;
    broadcast  the buffer in ``bucket_mb`` pieces from rank 0, on a worker thread, so that the
               hub keeps serving (heartbeats, new versions, acks) while the bytes move;
    acks       every member answers with the version it now holds (members that held it already
               take part and do not reload), within ``timeout_s`` of the broadcast;
    publish    ``weights_published`` to the broker once the round is over and a member holds it.

Generators on SGLang servers (their ``hello`` names the servers) take part differently: the same
round pushes the version to their servers through SGLang's own distributed weight update
(``broadcaster/sglang.py``), after the group broadcast, on the same worker thread; such a member
is acked when its servers took the version, and counts as failed (to be retried) otherwise.

With no generator the version is published at once. A late-joining generator makes the next
round re-form the group, so it gets the held version before its first lease (the generator
does not start a lease needing a newer version than it holds). A member that fails the
collective says so (``heartbeat`` with its old version) and takes part in the next round,
which re-forms the group; one that neither acks nor fails in time is dropped (its session is
forgotten, so its next message is refused and it must ``hello`` again) and left out of rounds
for ``2 × timeout_s``; one that leaves (``bye``) or goes silent is forgotten. Either way the
others still get the version: the next round re-forms without the lost member.

The broker link runs on its own thread (a ``Peer`` waits while it reconnects, and the hub must
not). The group's collectives run on a worker thread; everything else runs on the loop.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from april_async.broadcaster.sglang import SGLangFanout, SGLangFanoutConfig
from april_async.weights.flat import check_layout
from april_async.weights.group import GroupError, WeightGroup
from april_async.config import Endpoint, LinkConfig, LogConfig
from april_async.logs import get_logger
from april_async.wire import messages as m


class BroadcasterConfig(BaseModel):
    """The ``[broadcaster]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "broadcaster"
    """This instance's name: its sender name on its own hub and on the broker's."""
    bind: Endpoint = "tcp://127.0.0.1:5556"
    """The broadcaster's own ROUTER hub: learners hand versions over and generators open sessions here."""
    link: LinkConfig = LinkConfig()
    """Where the broker is, and the heartbeat timing of both the broker link and the hub."""
    max_update_bytes: int = Field(1 << 34, ge=1024)
    """The hub's message size limit (``max_message_bytes``): a ``weights_update`` carries every
    weight of a version in one message, so this bounds the model size (16 GiB: 8B parameters in
    bfloat16; a 300M float32 model is 1.2 GB)."""
    store_host: str = "127.0.0.1"
    """The address at which generators reach the TCPStore this process hosts (rendezvous). The
    store itself listens on every interface (torch's TCPStore has no bind address)."""
    store_port: int = Field(29600, ge=0, le=65535)
    """The TCPStore's port (0: any free port)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The group's backend; ``auto``: nccl where CUDA is present here, else gloo. Every generator
    must be able to use it: with nccl each rank needs a GPU of its own (not one shared with another
    rank), so a run with CPU generators, or all on one GPU, needs ``gloo``."""
    bucket_mb: float = Field(32.0, gt=0)
    """Broadcast the weights in pieces of this many MiB, one collective each."""
    timeout_s: float = Field(60.0, gt=0)
    """Limit of every collective and rendezvous, and of the wait for each member's ack."""
    status_file: Path | None = None
    """Where to keep a JSON status: held version, published version, epoch, each member's version."""
    sglang: SGLangFanoutConfig = SGLangFanoutConfig()
    """How versions reach the SGLang servers of generators on the ``sglang`` engine."""
    log: LogConfig = LogConfig()

    @property
    def hub_link(self) -> LinkConfig:
        """The hub's link: the broker link's timing, with ``max_update_bytes`` as the size limit."""
        return self.link.model_copy(update={"max_message_bytes": self.max_update_bytes})

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 1024 * 1024))

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


@dataclass
class Session:
    role: str
    identity: bytes
    version: int = -1  # a generator's held policy version (-1: none)
    joined: float = 0.0
    heard: float = 0.0  # last message from it
    last_sent: float = 0.0
    servers: tuple[str, ...] = ()  # a generator on SGLang servers: their URLs (it receives nothing itself)


@dataclass
class Held:
    version: int
    tensors: list[m.TensorSpec]
    buffer: torch.Tensor  # 1-D uint8, on the backend's device
    learner: str  # who handed it over


@dataclass
class Round:
    version: int
    epoch: int
    members: tuple[str, ...]
    held: Held
    rejoin: bool
    started: float
    job: _Job
    servers: dict[str, list[str]] = field(default_factory=dict)  # SGLang members and their servers
    collective_end: float | None = None
    timings: tuple[float, float] = (0.0, 0.0)  # (join, broadcast) seconds
    failed: str | None = None
    acked: set[str] = field(default_factory=set)
    nacked: set[str] = field(default_factory=set)
    announces: dict[str, m.WeightsAnnounce] = field(default_factory=dict)  # what each group member was sent


class _Job:
    """A blocking call on a daemon thread; the loop checks ``done`` and reads ``result``/``error``."""

    def __init__(self, fn, *args):
        self.result = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True, name="bcast-collective")
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:  # handed to the loop, which logs it and re-forms the group
            self.error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class BrokerLink:
    """The broker session on its own thread: ``hello`` as ``broadcaster``, and ``publish``."""

    def __init__(self, name: str, peer_factory, interval_s: float):
        self.name = name
        self.interval_s = interval_s
        self.version = -1  # the newest version published (re-announced in every hello)
        self._out: queue.Queue[m.WeightsPublished | None] = queue.Queue()
        self.peer = peer_factory(self._on_connect)
        self._thread = threading.Thread(target=self._run, daemon=True, name="bcast-broker")
        self._thread.start()

    def _on_connect(self, peer) -> None:
        peer.send(m.Hello(role="broadcaster", instance=self.name,
                          policy_version=self.version if self.version >= 0 else None))

    def publish(self, version: int, num_bytes: int) -> None:
        self.version = max(self.version, version)
        self._out.put(m.WeightsPublished(version=version, num_bytes=num_bytes))

    def _run(self) -> None:
        while True:
            try:
                body = self._out.get(timeout=self.interval_s)
            except queue.Empty:
                body = False
            if body is None:
                break
            if body:
                self.peer.send(body)
            while self.peer.poll(0.0) is not None:  # welcome, forwarded versions: nothing to do
                pass
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()

    def close(self, timeout_s: float = 2.0) -> None:
        self._out.put(None)
        self._thread.join(timeout_s)


class BroadcasterActor:
    def __init__(self, cfg: BroadcasterConfig, hub, broker_peer_factory, *, clock=time.monotonic):
        self.cfg = cfg
        self.hub = hub
        self.clock = clock
        self.backend = cfg.resolved_backend()
        self.epoch_id = os.urandom(6).hex()
        self.log = get_logger(actor="broadcaster", instance=cfg.name)
        self.group = WeightGroup.host(cfg.store_host, cfg.store_port, cfg.timeout_s)
        self.sessions: dict[str, Session] = {}
        self.benched: dict[str, float] = {}  # generator -> time until which rounds leave it out
        self.held: Held | None = None
        self.published = -1
        self.epoch = 0
        self.group_members: tuple[str, ...] = ()
        self.group_ok = False
        self.round: Round | None = None
        self.retry_at = 0.0
        self.rounds = 0
        self.failed_rounds = 0
        self._status_dirty = True
        self.broker = BrokerLink(cfg.name, broker_peer_factory, cfg.link.heartbeat_interval_s / 4)
        self.fanout: SGLangFanout | None = None  # made when the first SGLang generator says hello

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        self.log.info("serving", bind=self.hub.endpoint, store=self.group.store_address, backend=self.backend,
                      bucket_mb=self.cfg.bucket_mb)
        try:
            while not stop:
                for identity, msg in self.hub.poll(self.cfg.link.heartbeat_interval_s / 4):
                    self.handle(identity, msg, self.clock())
                self.tick(self.clock())
        finally:
            self.close()

    def close(self) -> None:
        if self.round is not None and not self.round.job.wait(min(self.cfg.timeout_s, 5.0)):
            self.log.warning("collective_abandoned", version=self.round.version, epoch=self.round.epoch)
        if self.fanout is not None:
            self.fanout.close()
        self.group.close()
        self.broker.close()
        self.hub.close()
        self._write_status()
        self.log.info("stopped", held=self.held.version if self.held else None, published=self.published,
                      rounds=self.rounds, failed_rounds=self.failed_rounds)

    # ------------------------------------------------------------------ messages

    def handle(self, identity: bytes, msg, now: float) -> None:
        body, sender = msg.body, msg.sender
        if isinstance(body, m.Hello):
            self._hello(identity, sender, body, now, msg.msg_id)
            return
        s = self.sessions.get(sender)
        if s is None:
            self.hub.send(identity, m.Error(code="refused", message=f"no session for {sender!r}: send hello"),
                          parent_id=msg.msg_id)
            return
        s.heard = now
        if isinstance(body, m.WeightsUpdate):
            self._update(s, sender, body, msg.msg_id)
        elif isinstance(body, m.Heartbeat):
            if body.policy_version is not None and s.role == "generator":
                self._ack(sender, s, body.policy_version)
        elif isinstance(body, m.Bye):
            self._forget(sender, reason=body.reason or "bye")
        elif isinstance(body, m.Error):
            self.log.warning("peer_error", peer=sender, code=body.code, message=body.message)
        else:
            self._send(sender, m.Error(code="refused", message=f"the broadcaster does not take {msg.msg_type}"),
                       parent_id=msg.msg_id)

    def _hello(self, identity: bytes, sender: str, body: m.Hello, now: float, msg_id: str) -> None:
        if body.role not in ("learner", "generator"):
            self.hub.send(identity, m.Error(code="refused", message=f"the broadcaster takes learners and generators, "
                                                                     f"not {body.role!r}"), parent_id=msg_id)
            return
        version = body.policy_version if body.policy_version is not None else -1
        old = self.sessions.get(sender)
        self.sessions[sender] = Session(body.role, identity, version, joined=old.joined if old else now, heard=now,
                                        servers=tuple(body.servers) if body.role == "generator" else ())
        if body.servers and self.fanout is None:
            host, _, port = self.group.store_address.rpartition(":")
            self.fanout = SGLangFanout(self.cfg.sglang, store=self.group.store, store_host=host, store_port=int(port),
                                       backend=self.backend, timeout_s=self.cfg.timeout_s, name=self.cfg.name)
        self._send(sender, m.Welcome(
            broker_epoch=self.epoch_id, policy_version=self.held.version if self.held else max(self.published, 0),
            heartbeat_interval_s=self.cfg.link.heartbeat_interval_s, peer_timeout_s=self.cfg.link.peer_timeout_s,
            max_message_bytes=self.cfg.max_update_bytes), parent_id=msg_id)
        self._status_dirty = True
        self.log.info("hello", peer=sender, role=body.role, version=body.policy_version)
        r = self.round
        if body.role == "generator" and r is not None and sender in r.members and sender not in r.servers:
            # A member opened a new session mid-round (it thought this process dead, say, while
            # it was stopped): what was sent to its old connection may be lost, its ack or our
            # announce. Its hello says what it holds. Holding the version: acked. Else, while the
            # collective still runs, it gets its announce again (a member receives each epoch and
            # version once, so a copy that did arrive is ignored); after it, the round failed
            # for it. Nobody waits for it until the round's timeout, nor benches it. (An SGLang
            # member is answered for by its servers' push, not by its session.)
            if version < r.version and r.collective_end is None and sender in r.announces:
                self._send(sender, r.announces[sender])
                self.log.info("announce_resent", peer=sender, version=r.version, epoch=r.epoch)
            else:
                self._ack(sender, self.sessions[sender], version)

    def _update(self, s: Session, sender: str, body: m.WeightsUpdate, msg_id: str) -> None:
        if s.role != "learner":
            self._send(sender, m.Error(code="refused", message=f"weights_update comes from learners, not a {s.role}"),
                       parent_id=msg_id)
            return
        if self.held is not None and body.version <= self.held.version:
            self.log.info("update_ignored", version=body.version, held=self.held.version)
            return
        try:
            check_layout(body.tensors, len(body.data))
        except ValueError as e:
            self.log.warning("update_refused", version=body.version, error=str(e))
            self._send(sender, m.Error(code="refused", message=f"weights_update {body.version}: {e}"[:500],
                                       field="tensors"), parent_id=msg_id)
            return
        with warnings.catch_warnings():  # a read-only view of the received frame; rank 0 only reads it
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.from_numpy(body.data)
        if self.backend == "nccl":
            buffer = buffer.to(self.group.device or torch.device("cuda", torch.cuda.current_device()))
        self.held = Held(body.version, list(body.tensors), buffer, sender)
        self._status_dirty = True
        self.log.info("update", version=body.version, tensors=len(body.tensors), bytes=len(body.data), learner=sender)

    def _ack(self, name: str, s: Session, version: int) -> None:
        s.version = version
        self._status_dirty = True
        r = self.round
        if r is None or name not in r.members or name in r.acked or name in r.nacked:
            return
        if version >= r.version:
            r.acked.add(name)
        else:  # the member's receive failed: it left the group and waits for the next round
            r.nacked.add(name)

    def _forget(self, name: str, reason: str) -> None:
        if self.sessions.pop(name, None) is not None:
            self._status_dirty = True
            self.log.info("peer_gone", peer=name, reason=reason)

    def _send(self, name: str, body: m.Body, parent_id: str | None = None) -> None:
        s = self.sessions.get(name)
        if s is not None and self.hub.send(s.identity, body, parent_id=parent_id):
            s.last_sent = self.clock()

    # ------------------------------------------------------------------ tick

    def tick(self, now: float) -> None:
        for name in self.hub.expired_peers(now):
            self._forget(name, reason="silent")
        for name, s in list(self.sessions.items()):
            if now - s.last_sent >= self.cfg.link.heartbeat_interval_s:
                self._send(name, m.Heartbeat(policy_version=self.held.version if self.held else None))
        if self.round is not None:
            self._progress(self.round, now)
        if self.round is None and now >= self.retry_at:
            self._maybe_start(now)
        if self._status_dirty:
            self._write_status()

    def _maybe_start(self, now: float) -> None:
        held = self.held
        if held is None:
            return
        gens = [name for name, s in sorted(self.sessions.items(), key=lambda kv: kv[1].joined)
                if s.role == "generator" and self.benched.get(name, 0.0) <= now]
        if not any(self.sessions[g].version < held.version for g in gens):
            if held.version > self.published:  # no generator, or all hold it already
                self._publish(held, members=len(gens))
            return
        # Members: the generators heard from lately (a dead one is not waited for in a rendezvous).
        fresh_s = self.cfg.link.peer_timeout_s / 2
        members = tuple(g for g in gens if now - self.sessions[g].heard <= fresh_s)
        if not any(self.sessions[g].version < held.version for g in members):
            return  # those that need it are quiet: wait until they speak again or expire
        servers = {g: list(self.sessions[g].servers) for g in members if self.sessions[g].servers}
        receivers = tuple(g for g in members if g not in servers)  # members of the torch.distributed group
        rejoin = bool(receivers) and (receivers != self.group_members or not self.group_ok)
        if rejoin:
            self.epoch += 1
            self.group_members, self.group_ok = receivers, True
        world = len(receivers) + 1
        store = self.group.store_address
        announces = {}
        for rank, name in enumerate(receivers, start=1):
            announces[name] = m.WeightsAnnounce(
                version=held.version, tensors=held.tensors, num_bytes=held.buffer.numel(),
                bucket_bytes=self.cfg.bucket_bytes, group=m.GroupSpec(
                    epoch=self.epoch, rank=rank, world_size=world, store=store, backend=self.backend,
                    timeout_s=self.cfg.timeout_s))
            self._send(name, announces[name])
        root = None
        if receivers:
            root = m.GroupSpec(epoch=self.epoch, rank=0, world_size=world, store=store, backend=self.backend,
                               timeout_s=self.cfg.timeout_s)
        job = _Job(self._collective, root, held, self.cfg.bucket_bytes, rejoin, servers)
        self.round = Round(held.version, self.epoch, members, held, rejoin, now, job, servers=servers,
                           announces=announces)
        self.log.debug("round_started", version=held.version, epoch=self.epoch, members=list(members), rejoin=rejoin,
                       sglang=sorted(servers))

    def _collective(self, spec: m.GroupSpec | None, held: Held, bucket_bytes: int, rejoin: bool,
                    servers: dict[str, list[str]]) -> tuple[float, float, str | None, dict[str, str | None]]:
        """Worker thread: (re-)join the group if needed and broadcast (``spec``: there are members
        to receive), then push to the SGLang servers. Returns the seconds of the join and of the
        broadcast, the broadcast's failure (None: fine), and each SGLang member's failure."""
        t0 = t1 = time.monotonic()
        failed = None
        if spec is not None:
            try:
                if rejoin:
                    self.group.join(spec)
                t1 = time.monotonic()
                self.group.broadcast(held.buffer, bucket_bytes, tag=held.version)
            except GroupError as e:
                failed = str(e)
        t2 = time.monotonic() if spec is not None else t1  # no broadcast: no rate to report
        pushed = {}
        if servers:
            pushed = self.fanout.push(servers, held.version, held.tensors, held.buffer, bucket_bytes)
        return t1 - t0, t2 - t1, failed, pushed

    def _progress(self, r: Round, now: float) -> None:
        if r.collective_end is None:
            if not r.job.done:
                return
            r.collective_end = now
            if r.job.error is not None:  # a bug, not a failed collective: every member counts as failed
                err = r.job.error
                r.failed = f"{type(err).__name__}: {err}"
                r.nacked.update(r.servers)
            else:
                join_s, bcast_s, r.failed, pushed = r.job.result
                r.timings = (join_s, bcast_s)
                for name, why in pushed.items():  # SGLang members answer through the push itself
                    if why is None and name in self.sessions:
                        self.sessions[name].version = r.version
                    (r.acked if why is None else r.nacked).add(name)
        present = {n for n in r.members if n in self.sessions}
        pending = present - r.acked - r.nacked
        if pending and now < r.collective_end + self.cfg.timeout_s:
            return
        self._finish(r, now, late=pending)

    def _finish(self, r: Round, now: float, late: set[str]) -> None:
        self.round = None
        self.rounds += 1
        gone = {n for n in r.members if n not in self.sessions}
        for name in late:  # neither acked nor failed in time: forget it, and leave it out for a while
            self._forget(name, reason="no_ack")
            self.benched[name] = now + 2 * self.cfg.timeout_s
        lost = bool(r.failed or r.nacked or late or gone)
        if lost:
            self.group_ok = False
            self.failed_rounds += 1
            self.retry_at = now + self.cfg.link.peer_timeout_s / 2  # by then a dead member is no longer fresh
        join_s, bcast_s = r.timings
        num_bytes = r.held.buffer.numel()
        fields = dict(version=r.version, epoch=r.epoch, members=len(r.members), acked=len(r.acked),
                      bytes=num_bytes, join_s=round(join_s, 3), bcast_s=round(bcast_s, 3),
                      gb_s=round(num_bytes / bcast_s / 1e9, 3) if bcast_s > 0 and not r.failed else None,
                      s=round(now - r.started, 3))
        if lost:
            self.log.warning("round_incomplete", failed=r.failed, nacked=sorted(r.nacked), late=sorted(late),
                             gone=sorted(gone), **fields)
        else:
            self.log.info("round", **fields)
        if r.acked and r.version > self.published:
            self._publish(r.held, members=len(r.acked))
        self._status_dirty = True

    def _publish(self, held: Held, members: int) -> None:
        self.published = held.version
        self.broker.publish(held.version, held.buffer.numel())
        self._status_dirty = True
        self.log.info("published", version=held.version, bytes=held.buffer.numel(), generators=members)

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        return {"version": self.held.version if self.held else -1, "published": self.published, "epoch": self.epoch,
                "members": {n: s.version for n, s in self.sessions.items() if s.role == "generator"},
                "rounds": self.rounds, "failed_rounds": self.failed_rounds}

    def _write_status(self) -> None:
        self._status_dirty = False
        if self.cfg.status_file is None:
            return
        path = Path(self.cfg.status_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.status(), sort_keys=True))
        tmp.replace(path)
