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

The round logic (sessions, epochs, acks, benching, publishing) is ``rounds.RoundPlanner``, pure
and tested on its own; this module carries out what it decides. The broker link runs on its own
thread (a ``Peer`` waits while it reconnects, and the hub must not). The group's collectives run
on a worker thread, whose result goes back to the planner; everything else runs on the loop.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from april_async.broadcaster.config import BroadcasterConfig
from april_async.broadcaster.rounds import (
    CollectiveResult,
    Forget,
    Keep,
    Log,
    Open,
    Publish,
    Reply,
    RoundPlanner,
    Send,
    StartCollective,
    StatusChanged,
)
from april_async.broadcaster.sglang import SGLangFanout
from april_async.logs import get_logger
from april_async.weights.flat import check_layout
from april_async.weights.group import GroupError, WeightGroup
from april_async.wire import messages as m


def resolved_backend(cfg: BroadcasterConfig) -> Literal["gloo", "nccl"]:
    """The group's backend: ``auto`` is nccl where CUDA is present here, else gloo."""
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return cfg.backend


@dataclass
class Link:
    """The hub side of a session: where its messages go, and when one last went."""

    identity: bytes
    last_sent: float = 0.0


@dataclass
class Buffer:
    """A version's bytes: 1-D uint8, on the backend's device."""

    version: int
    tensors: list[m.TensorSpec]
    data: torch.Tensor


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
    """The I/O around a ``RoundPlanner``: the hub, the broker link, the collective's worker
    thread, the held bytes, the SGLang fan-out and the status file."""

    def __init__(self, cfg: BroadcasterConfig, hub, broker_peer_factory, *, clock=time.monotonic):
        self.cfg = cfg
        self.hub = hub
        self.clock = clock
        self.backend = resolved_backend(cfg)
        self.log = get_logger(actor="broadcaster", instance=cfg.name)
        self.group = WeightGroup.host(cfg.store_host, cfg.store_port, cfg.timeout_s)
        self.planner = RoundPlanner(cfg, backend=self.backend, store=self.group.store_address,
                                    epoch_id=os.urandom(6).hex())
        self.links: dict[str, Link] = {}
        self.held: Buffer | None = None
        self.job: _Job | None = None  # the round's collective, until its end is fed to the planner
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
        r = self.planner.round
        if self.job is not None and not self.job.wait(min(self.cfg.timeout_s, 5.0)) and r is not None:
            self.log.warning("collective_abandoned", version=r.version, epoch=r.epoch)
        if self.fanout is not None:
            self.fanout.close()
        self.group.close()
        self.broker.close()
        self.hub.close()
        self._write_status()
        p = self.planner
        self.log.info("stopped", held=p.held_version, published=p.published, rounds=p.rounds,
                      failed_rounds=p.failed_rounds)

    # ------------------------------------------------------------------ messages

    def handle(self, identity: bytes, msg, now: float) -> None:
        body, sender, p = msg.body, msg.sender, self.planner
        if isinstance(body, m.Hello):
            effects = p.hello(sender, body.role, body.policy_version, body.servers, now)
            if body.servers and self.fanout is None and any(isinstance(e, Open) for e in effects):
                host, _, port = self.group.store_address.rpartition(":")
                self.fanout = SGLangFanout(self.cfg.sglang, store=self.group.store, store_host=host,
                                           store_port=int(port), backend=self.backend,
                                           timeout_s=self.cfg.timeout_s, name=self.cfg.name)
            self._apply(effects, identity, msg)
            return
        if not p.touch(sender, now):
            self.hub.send(identity, m.Error(code="refused", message=f"no session for {sender!r}: send hello"),
                          parent_id=msg.msg_id)
            return
        if isinstance(body, m.WeightsUpdate):
            try:
                check_layout(body.tensors, len(body.data))
                layout_error = None
            except ValueError as e:
                layout_error = str(e)
            self._apply(p.update(sender, body.version, body.tensors, len(body.data), layout_error, now),
                        identity, msg)
        elif isinstance(body, m.Heartbeat):
            self._apply(p.heartbeat(sender, body.policy_version, now), identity, msg)
        elif isinstance(body, m.Bye):
            self._apply(p.bye(sender, body.reason, now), identity, msg)
        elif isinstance(body, m.Error):
            self.log.warning("peer_error", peer=sender, code=body.code, message=body.message)
        else:
            self._send(sender, m.Error(code="refused",
                                       message=f"the broadcaster does not take {msg.msg_type}"),
                       parent_id=msg.msg_id)

    def _keep(self, version: int, body: m.WeightsUpdate) -> None:
        """The update in hand is held: its bytes as a tensor (on the GPU for nccl)."""
        with warnings.catch_warnings():  # a read-only view of the received frame; rank 0 only reads it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(body.data)
        if self.backend == "nccl":
            data = data.to(self.group.device or torch.device("cuda", torch.cuda.current_device()))
        self.held = Buffer(version, list(body.tensors), data)

    def _send(self, name: str, body: m.Body, parent_id: str | None = None) -> None:
        link = self.links.get(name)
        if link is not None and self.hub.send(link.identity, body, parent_id=parent_id):
            link.last_sent = self.clock()

    # ------------------------------------------------------------------ effects

    def _apply(self, effects, identity: bytes | None = None, msg=None) -> None:
        """Carry out the planner's effects in order; ``identity``/``msg``: the message in hand."""
        for e in effects:
            if isinstance(e, Send):
                self._send(e.name, e.body, parent_id=msg.msg_id if e.reply and msg is not None else None)
            elif isinstance(e, Log):
                getattr(self.log, e.level)(e.event, **e.fields)
            elif isinstance(e, StatusChanged):
                self._status_dirty = True
            elif isinstance(e, Open):
                self.links[e.name] = Link(identity)
            elif isinstance(e, Forget):
                self.links.pop(e.name, None)
            elif isinstance(e, Reply):
                self.hub.send(identity, e.body, parent_id=msg.msg_id)
            elif isinstance(e, Keep):
                self._keep(e.version, msg.body)
            elif isinstance(e, StartCollective):
                self._start(e)
            elif isinstance(e, Publish):
                self.broker.publish(e.version, e.num_bytes)
            else:
                raise TypeError(f"unknown effect {e!r}")

    def _start(self, e: StartCollective) -> None:
        held = self.held
        if held is None or held.version != e.version:
            raise RuntimeError(f"the planner started version {e.version}; the bytes held are of "
                               f"{held.version if held else None}")
        self.job = _Job(self._collective, e.root, held, e.bucket_bytes, e.rejoin, e.servers)

    def _collective(self, spec: m.GroupSpec | None, held: Buffer, bucket_bytes: int, rejoin: bool,
                    servers: dict[str, list[str]]) -> CollectiveResult:
        """Worker thread: (re-)join the group if needed and broadcast (``spec``: there are members
        to receive), then push to the SGLang servers."""
        t0 = t1 = time.monotonic()
        failed = None
        if spec is not None:
            try:
                if rejoin:
                    self.group.join(spec)
                t1 = time.monotonic()
                self.group.broadcast(held.data, bucket_bytes, tag=held.version)
            except GroupError as e:
                failed = str(e)
        t2 = time.monotonic() if spec is not None else t1  # no broadcast: no rate to report
        pushed = {}
        if servers:
            pushed = self.fanout.push(servers, held.version, held.tensors, held.data, bucket_bytes)
        return CollectiveResult(t1 - t0, t2 - t1, failed, pushed)

    # ------------------------------------------------------------------ tick

    def tick(self, now: float) -> None:
        p = self.planner
        for name in self.hub.expired_peers(now):
            self._apply(p.expired(name, now))
        for name, link in list(self.links.items()):
            if now - link.last_sent >= self.cfg.link.heartbeat_interval_s:
                self._send(name, m.Heartbeat(policy_version=p.held_version))
        if self.job is not None and self.job.done:
            job, self.job = self.job, None
            if job.error is not None:  # a bug, not a failed collective: every member counts as failed
                self._apply(p.collective_finished(now, error=f"{type(job.error).__name__}: {job.error}"))
            else:
                self._apply(p.collective_finished(now, result=job.result))
        self._apply(p.tick(now))
        if self._status_dirty:
            self._write_status()

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        return self.planner.status()

    def _write_status(self) -> None:
        self._status_dirty = False
        if self.cfg.status_file is None:
            return
        path = Path(self.cfg.status_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.status(), sort_keys=True))
        tmp.replace(path)
