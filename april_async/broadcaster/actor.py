"""The broadcaster actor: holds the newest policy version and fans it out to the generators.

Start:  april broadcaster --config run.toml   (section [broadcaster])

Sessions. Learners and generators open sessions on the broadcaster's own hub with ``hello``
(role ``learner`` or ``generator``; a generator's carries the version it holds). A learner hands
each new version over once (``weights_update``); only the newest is kept, an older or equal one
is ignored. A message the session's role may not send (``wire.roles``), and a ``weights_update``
from a second learner instance while the first one's session lives (``roles.VersionRight``), are
refused and acted on in nothing. A generator acknowledges each version with ``heartbeat`` ``policy_version``. A version
in one message is held as it arrived, without a copy: the hub takes large bulk frames as views of
ZeroMQ's own message (``Hub._recv_frames``), which lives until a newer version replaces it.

Parts (protocol 1.4). A version may also come as ``parts`` messages, consecutive byte ranges of
its buffer: they are assembled, checked and refused by ``weights.handoff_recv`` (the receiving half
of the hand-off, beside its sending half, ``weights.handoff``), which hands the whole version on
exactly as a one-part update, with its digests hashed while the parts came.

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
is acked when its servers took the version (and sent a ``heartbeat`` naming it at once: its
generator reads its servers' versions then), and counts as failed (to be retried) otherwise.

With no generator the version is published at once. A late-joining generator makes the next
round re-form the group, so it gets the held version before its first lease (the generator
does not start a lease needing a newer version than it holds). A member that fails the
collective says so (``heartbeat`` with its old version) and takes part in the next round,
which re-forms the group; one that neither acks nor fails in time is dropped (its session is
forgotten, so its next message is refused and it must ``hello`` again) and left out of rounds
for ``2 × timeout_s``; one that leaves (``bye``) or goes silent is forgotten, and if the round's
collective still waits for it, the collective is cut (``WeightGroup.sever``) rather than waited
out. A generator killed and started again under its name says hello from a new process (another
``incarnation``, protocol 1.8): the old process's rank is treated the same way at once, and the
new one joins a new epoch. Either way the others still get the version: the next round re-forms
without the lost member, at once, and nobody else is benched for the loss.

Protocol 1.6. Every announce carries a digest of each bucket of the version
(``flat.bucket_digests``), and members check the bytes they receive against them before loading:
bytes from anyone but this process fail. The digests are computed once per version, off the loop:
those of a version in parts while its parts arrive (above), the others on a thread of their own
right after the version is kept (hashing a large version takes seconds, which the
hub must not stall for); a round of that version starts once they are known. Since 1.7 they are
BLAKE3-128 (about 5x faster than BLAKE2b here) when every member of the round said hello with
protocol 1.7 or later, else BLAKE2b-128 (``weights_announce.digest_alg``; the planner decides, and
has a held version hashed again when its round's members need the other one). The group's store
keys live under a secret drawn once per process (``secrets.token_hex(16)``) and sent only inside
announces: nobody guesses them or meets them by accident. They do not live in the TCPStore,
which lists its keys to anyone who reaches its port (``list_keys``): the group meets on the
rendezvous store this process hosts on ``store_host:rendezvous_port`` (``weights.zstore``), a
ZeroMQ service secured like the hub, that lists nothing, and whose endpoint every ``GroupSpec``
names (``rendezvous``). The TCPStore stays up for SGLang's weight-update group only, whose
servers cannot speak ZeroMQ (SPEC, known weaknesses 1).

Shared memory (protocol 1.7). With ``handoff = "auto"`` the welcome to a learner names this host
(``host_id``); a learner on the same host then writes its versions into a ``/dev/shm`` region and
its ``weights_update`` names the region (``region``) instead of carrying the bytes. The region is
mapped (once per name, ``shm.RegionCache``), its header checked against the handle, and the
version is held and broadcast straight from the mapping, with no copy. The learner may write into
a region again only once this process no longer reads it: every heartbeat to that learner lists
the regions of the held version and of a broadcast in progress (``regions``), and one is sent at
once whenever that list changes. A region that cannot be opened, or that no longer holds the
generation its handle names, is answered with ``error`` ``region_unavailable``, and the learner
sends the bytes instead; a region found overwritten once its digests are computed is not
broadcast (``region_overwritten``).

LoRA adapters (protocol 1.10). A version may be a LoRA adapter (``weights_update.adapter``, in part
0): it is taken, held, hashed and broadcast as any version, and every announce of it carries the
adapter. Its rounds leave out the generators whose hello said a protocol older than 1.10 (they
would load the adapter's tensors as full weights): each is warned about once per version, and none
is waited for (``rounds``). SGLang members take it through SGLang's LoRA routes: the adapter is
written in peft's files under ``lora_dir`` and loaded on their servers as ``april-v<N>``
(``broadcaster.sglang``), after which their generators' requests name it.

The round logic (sessions, epochs, acks, benching, publishing) is ``rounds.RoundPlanner``, pure
and tested on its own; this module carries out what it decides. The broker link runs on its own
thread (a ``Peer`` waits while it reconnects, and the hub must not). The group's collectives run
on a worker thread, whose result goes back to the planner; everything else runs on the loop.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np
import torch

from april_async.broadcaster.config import BroadcasterConfig
from april_async.broadcaster.rounds import (
    CollectiveResult,
    Forget,
    Hash,
    Keep,
    Log,
    Open,
    Publish,
    Reply,
    RoundPlanner,
    Send,
    Sever,
    StartCollective,
    StatusChanged,
)
from april_async.logs import get_logger
from april_async.runtime import incarnation
from april_async.weights import shm
from april_async.weights.flat import bucket_digests, check_layout
from april_async.weights.group import GroupError, WeightGroup
from april_async.weights.handoff_recv import PartRefused, PartsReceiver, Whole
from april_async.wire import messages as m
from april_async.wire import roles
from april_async.wire.version import parse

if TYPE_CHECKING:
    from april_async.broadcaster.sglang import SGLangFanout


def resolved_backend(cfg: BroadcasterConfig) -> Literal["gloo", "nccl"]:
    """The group's backend: ``auto`` is nccl where CUDA is present here, else gloo."""
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return cfg.backend


def _port(endpoint: str) -> int:
    """The port of a ``tcp://host:port`` endpoint (0 for another transport)."""
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


JOB_POLL_S = 0.002
"""The loop's poll timeout while a worker thread's result is due (``_poll_timeout_s``)."""
KEY_PREFIX_SINCE = (1, 6)  # the protocol version since which the group's keys live under ``key_prefix``


def _cannot_join(hello: m.Hello, msg) -> str | None:
    """Why the generator saying ``hello`` (in the message ``msg``) cannot be a member of the
    group for its protocol version, or None.

    A generator older than 1.6 ignores ``key_prefix`` and would wait for its group under keys
    that rank 0 never writes, timing out in every round; refusing its hello says so at once.
    (Falling back to no prefix would hand the keys back to anyone on the store port.) One on
    SGLang servers (``servers``) receives nothing over the group and is welcome."""
    if hello.role != "generator" or hello.servers or parse(msg.proto_version) >= KEY_PREFIX_SINCE:
        return None
    return (f"a generator of protocol {msg.proto_version} cannot join this broadcaster's weights group: since "
            f"{'.'.join(map(str, KEY_PREFIX_SINCE))} its store keys live under GroupSpec.key_prefix; upgrade the "
            f"generator")


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
    owned: np.ndarray | None = None
    """The receive buffer that ``data`` views, when it was assembled here (to be reused)."""
    region: shm.MappedRegion | None = None
    """The learner's shared-memory region that ``data`` views, when the version came in one."""
    prehashed: tuple[str, list[Future]] | None = None
    """``(digest_alg, one future per bucket)``: the digests of an assembly, hashed as its parts came."""
    adapter: m.AdapterSpec | None = None
    """Since 1.10: the version is this LoRA adapter's tensors (None: full weights)."""




class _Job:
    """A blocking call on a daemon thread; the loop checks ``done`` and reads ``result``/``error``."""

    def __init__(self, fn, *args, name: str = "bcast-collective"):
        self.result = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True, name=name)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- handed to the loop, which logs it and re-forms the group
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
        peer.send(m.Hello(role="broadcaster", instance=self.name, incarnation=incarnation(),
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
        self.group = WeightGroup.host(cfg.store_host, cfg.store_port, cfg.timeout_s,
                                      rendezvous_port=cfg.rendezvous_port, keys=cfg.link.keys,
                                      allow_open=cfg.link.allow_open)
        self.planner = RoundPlanner(cfg, backend=self.backend, store=self.group.store_address,
                                    epoch_id=os.urandom(6).hex(), key_prefix=secrets.token_hex(16),
                                    rendezvous=self.group.rendezvous or "")
        # ``sever`` cuts the group's own connections, never the hub's nor the broker link's.
        self.group.keep_ports.update(_port(e) for e in (hub.endpoint, cfg.link.broker))
        self.links: dict[str, Link] = {}
        self.instances: dict[str, str] = {}  # sender -> the instance its hello named, for every session
        self.version_right = roles.VersionRight()  # which learner instance hands versions over now
        self.held: Buffer | None = None
        self.job: _Job | None = None  # the round's collective, until its end is fed to the planner
        self._joined = threading.Event()  # the job's join is over (its rendezvous is no longer looked at)
        self._job_buffer: Buffer | None = None  # what the job reads
        self._digest_job: tuple[int, str, _Job] | None = None  # (version, digest_alg, job): being hashed
        self.parts = PartsReceiver(  # versions in parts, assembled; the receive buffers, reused
            bucket_bytes=cfg.bucket_bytes, max_update_bytes=cfg.max_update_bytes, log=self.log,
            reading=lambda: self._job_buffer.owned if self._job_buffer is not None else None)
        self.host_id = shm.host_id() if cfg.handoff == "auto" else None  # offered to learners in welcome
        self.regions = shm.RegionCache()
        self._region_learner: str | None = None  # the learner whose regions this process reads
        self._regions_told: tuple = ()  # the regions last listed to it
        self._status_dirty = True
        self.last_status: dict = {}  # the loop's last status (broadcaster.json), for /metrics
        self.broker = BrokerLink(cfg.name, broker_peer_factory, cfg.link.heartbeat_interval_s / 4)
        self.fanout: SGLangFanout | None = None  # made when the first SGLang generator says hello
        self._next_recover = 0.0  # when the SGLang servers are next recovered (``recover_interval_s``)

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        self.log.info("serving", bind=self.hub.endpoint, store=self.group.store_address,
                      rendezvous=self.group.rendezvous, backend=self.backend,
                      bucket_mb=self.cfg.bucket_mb)
        try:
            while not stop:
                for identity, msg in self.hub.poll(self._poll_timeout_s()):
                    self.handle(identity, msg, self.clock())
                self.tick(self.clock())
        finally:
            self.close()

    def _poll_timeout_s(self) -> float:
        """How long the loop may wait for a message: short while a worker thread's result is
        due (digests, a collective), since no message announces it and the next step of the round
        waits on it (a whole ``heartbeat_interval_s / 4`` was 0.125 s, longer than hashing 123 MB)."""
        if self._digest_job is not None or self.job is not None:
            return JOB_POLL_S
        return self.cfg.link.heartbeat_interval_s / 4

    def close(self) -> None:
        r = self.planner.round
        if self.job is not None and not self.job.wait(min(self.cfg.timeout_s, 5.0)) and r is not None:
            self.log.warning("collective_abandoned", version=r.version, epoch=r.epoch)
        if self.fanout is not None:
            self.fanout.close()
        self.group.close()
        self.broker.close()
        self.hub.close()
        self.held = self._job_buffer = None
        self.regions.clear()
        self.parts.close()
        self._write_status()
        p = self.planner
        self.log.info("stopped", held=p.held_version, published=p.published, rounds=p.rounds,
                      failed_rounds=p.failed_rounds)

    # ------------------------------------------------------------------ messages

    def handle(self, identity: bytes, msg, now: float) -> None:
        body, sender, p = msg.body, msg.sender, self.planner
        if isinstance(body, m.Hello) and (why := _cannot_join(body, msg)) is not None:
            self.log.warning("hello_refused", peer=sender, proto_version=msg.proto_version, error=why)
            self.hub.send(identity, m.Error(code="refused", message=why), parent_id=msg.msg_id)
            return
        if isinstance(body, m.Hello):
            proto = parse(msg.proto_version) if body.role == "generator" else None  # picks the digests' hash
            effects = p.hello(sender, body.role, body.policy_version, body.servers, now, proto=proto,
                              incarnation=body.incarnation)
            if body.role == "learner" and self.host_id is not None:  # offer shared memory (1.7)
                effects = [Send(e.name, msgspec.structs.replace(e.body, host_id=self.host_id), e.reply)
                           if isinstance(e, Send) and isinstance(e.body, m.Welcome) else e for e in effects]
            if body.servers and self.fanout is None and any(isinstance(e, Open) for e in effects):
                from april_async.broadcaster.sglang import SGLangFanout  # httpx only once SGLang is in the run

                host, _, port = self.group.store_address.rpartition(":")
                self.fanout = SGLangFanout(self.cfg.sglang, store=self.group.store, store_host=host,
                                           store_port=int(port), backend=self.backend,
                                           timeout_s=self.cfg.timeout_s, name=self.cfg.name,
                                           lora_dir=self.cfg.lora_root())
                self._next_recover = now + self.cfg.sglang.recover_interval_s  # the hello's own comes first
            if body.servers and self.fanout is not None:
                # A broadcaster that died mid-push may have left these servers paused, or with a
                # weight-update session open; a generator already at the held version gets no push
                # that would clear it. Off this loop (a server that does not answer takes a call
                # timeout, longer than the peers' heartbeats), after any push in flight.
                self.fanout.recover_soon(body.servers)
            if any(isinstance(e, Open) for e in effects):
                self.instances[sender] = body.instance
            self._apply(effects, identity, msg)
            return
        session = p.sessions.get(sender)
        if session is None:
            self.hub.send(identity, m.Error(code="refused", message=f"no session for {sender!r}: send hello"),
                          parent_id=msg.msg_id)
            return
        why = roles.refusal(session.role, msg.msg_type)
        if why is None and isinstance(body, m.WeightsUpdate):  # one learner instance hands versions over
            why = self.version_right.claim(session.role, self.instances.get(sender, ""),
                                           ((n, s.role, self.instances.get(n, "")) for n, s in p.sessions.items()))
        if why is not None:  # acted on in nothing, heard included
            self.log.warning("refused", peer=sender, role=session.role, msg_type=msg.msg_type, error=why)
            self.hub.send(identity, m.Error(code="refused", message=why), parent_id=msg.msg_id)
            return
        p.touch(sender, now)
        if isinstance(body, m.WeightsUpdate):
            self._update(sender, identity, msg, now)
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

    # ------------------------------------------------------------------ updates, whole or in parts

    def _update(self, sender: str, identity: bytes, msg, now: float) -> None:
        body: m.WeightsUpdate = msg.body
        if body.region is not None:
            self._update_region(sender, identity, msg, now)
            return
        try:
            adapter = body.adapter is not None
            whole = self.parts.take(sender, body, lambda: self.planner.digest_alg(now, adapter))
        except PartRefused as e:
            self.log.warning("update_part_refused", version=body.version, part=body.part, parts=body.parts,
                             field=e.field, error=e.why, learner=sender)
            why = f"weights_update {body.version} part {body.part} of {body.parts}: {e.why}"[:500]
            self._send(sender, m.Error(code=e.code, message=why, field=f"$.body.{e.field}"), parent_id=msg.msg_id)
            return
        if whole is not None:
            self._complete(sender, whole, identity, msg, now)

    def _update_region(self, sender: str, identity: bytes, msg, now: float) -> None:
        """A version in the learner's shared-memory region: mapped, checked and held in place."""
        body: m.WeightsUpdate = msg.body
        region = body.region
        self.parts.supersede(body.version)
        if region.nbytes > self.cfg.max_update_bytes:
            why = f"region of {region.nbytes} bytes is over the broadcaster's max_update_bytes {self.cfg.max_update_bytes}"
            self._send(sender, m.Error(code="too_large", message=why, field="$.body.region.nbytes"),
                       parent_id=msg.msg_id)
            return
        if self.host_id is None:
            why = "this broadcaster takes no hand-off in shared memory (handoff = zmq)"
        else:
            try:
                mapped = self.regions.open(region)
                why = None
            except shm.RegionError as e:
                why = str(e)
        if why is not None:
            self.log.warning("region_unavailable", version=body.version, region=region.name,
                             generation=region.generation, error=why, learner=sender)
            self._send(sender, m.Error(code="region_unavailable", message=why[:500], field="$.body.region"),
                       parent_id=msg.msg_id)
            return
        self._region_learner = sender
        whole = Whole(body.version, body.tensors, mapped.array, adapter=body.adapter)
        self._complete(sender, whole, identity, msg, now, region=mapped)

    def _regions_in_use(self) -> tuple[m.SharedRegion, ...]:
        """The learner's regions this process still reads: the held version's, a broadcast's."""
        out: dict[str, m.SharedRegion] = {}
        for buf in (self.held, self._job_buffer):
            if buf is not None and buf.region is not None:
                out[buf.region.handle.name] = buf.region.handle
        return tuple(out.values())

    def _tell_regions(self) -> None:
        """Tell the learner at once when the regions read change (it writes into a freed one)."""
        if self._region_learner is None:
            return
        regions = self._regions_in_use()
        if regions != self._regions_told:
            self._regions_told = regions
            self._send(self._region_learner, m.Heartbeat(policy_version=self.planner.held_version,
                                                         regions=list(regions)))

    def _complete(self, sender: str, whole: Whole, identity: bytes, msg, now: float,
                  region: shm.MappedRegion | None = None) -> None:
        """A whole version is in hand: the planner decides, as for any update."""
        try:
            check_layout(whole.tensors, len(whole.data))
            layout_error = None
        except ValueError as e:
            layout_error = str(e)
        effects = self.planner.update(sender, whole.version, whole.tensors, len(whole.data), layout_error, now,
                                      digests=None, adapter=whole.adapter)
        self._apply(effects, identity, msg, update=(whole, region))
        if whole.owned and not any(isinstance(e, Keep) for e in effects):
            self.parts.unused(whole)  # ignored or refused: the buffer is free again

    def _keep(self, version: int, whole: Whole, region: shm.MappedRegion | None) -> None:
        """The update in hand is held: its bytes as a tensor (on the GPU for nccl). Its digests
        are computed when the planner says under which algorithm (``Hash``, next)."""
        data, owned = whole.data, whole.owned
        with warnings.catch_warnings():  # a read-only view of the received frame; rank 0 only reads it
            warnings.simplefilter("ignore", UserWarning)
            held = torch.from_numpy(data)
        replaced = self.held
        if self.backend == "nccl":
            held = held.to(self.group.device or torch.device("cuda", torch.cuda.current_device()))
            if owned and whole.prehashed:  # copied to the GPU; free again once its buckets are hashed
                self.parts.free_after_hashing(data)
                owned = False
            elif owned:
                self.parts.free(data)  # copied to the GPU: the receive buffer is free again
                owned = False
            region = None  # copied to the GPU: the learner's region is free again
        self.held = Buffer(version, list(whole.tensors), held, data if owned else None, region,
                           whole.prehashed, whole.adapter)
        if replaced is not None and replaced.owned is not None:
            self.parts.free(replaced.owned)  # reused once no collective reads it (``PartsReceiver._buffer``)

    def _hash(self, version: int, alg: str) -> None:
        """Compute the held version's digests under ``alg`` on a thread of their own: those hashed
        as its parts arrived when they are of ``alg``, else all of them now. A job still hashing
        for a replaced version or algorithm is left to end, its result unused."""
        held = self.held
        if held is None or held.version != version:
            raise RuntimeError(f"the planner asked for the digests of version {version}; the bytes held are "
                               f"of {held.version if held else None}")
        prehashed, held.prehashed = held.prehashed, None
        if prehashed is not None and prehashed[0] == alg:
            futures = prehashed[1]
            job = _Job(lambda: [f.result() for f in futures], name="bcast-digests")
        else:
            for future in prehashed[1] if prehashed else ():
                future.cancel()
            job = _Job(bucket_digests, held.data, self.cfg.bucket_bytes, alg, name="bcast-digests")
        self._digest_job = (version, alg, job)

    def _send(self, name: str, body: m.Body, parent_id: str | None = None) -> None:
        link = self.links.get(name)
        if link is not None and self.hub.send(link.identity, body, parent_id=parent_id):
            link.last_sent = self.clock()

    # ------------------------------------------------------------------ effects

    def _apply(self, effects, identity: bytes | None = None, msg=None, update=None) -> None:
        """Carry out the planner's effects in order; ``identity``/``msg``: the message in hand;
        ``update``: ``(whole, region)``, the version in hand, for ``Keep``."""
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
                self.instances.pop(e.name, None)
            elif isinstance(e, Reply):
                self.hub.send(identity, e.body, parent_id=msg.msg_id)
            elif isinstance(e, Keep):
                self._keep(e.version, *update)
            elif isinstance(e, Hash):
                self._hash(e.version, e.digest_alg)
            elif isinstance(e, StartCollective):
                self._start(e)
            elif isinstance(e, Sever):
                cut = self.group.sever()
                self.log.info("collective_severed", member=e.member, reason=e.reason, connections=cut)
            elif isinstance(e, Publish):
                self.broker.publish(e.version, e.num_bytes)
            else:
                raise TypeError(f"unknown effect {e!r}")

    def _start(self, e: StartCollective) -> None:
        held = self.held
        if held is None or held.version != e.version:
            raise RuntimeError(f"the planner started version {e.version}; the bytes held are of "
                               f"{held.version if held else None}")
        self._job_buffer = held
        self._joined.clear()
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
                self._joined.set()
                t1 = time.monotonic()
                self.group.broadcast(held.data, bucket_bytes, tag=held.version)
            except GroupError as e:
                failed = str(e)
        t2 = time.monotonic() if spec is not None else t1  # no broadcast: no rate to report
        pushed = {}
        if servers:
            pushed = self.fanout.push(servers, held.version, held.tensors, held.data, bucket_bytes,
                                      adapter=held.adapter)
        return CollectiveResult(t1 - t0, t2 - t1, failed, pushed)

    # ------------------------------------------------------------------ tick

    def tick(self, now: float) -> None:
        p = self.planner
        for name in self.hub.expired_peers(now):
            self._apply(p.expired(name, now))
        for name, link in list(self.links.items()):
            if now - link.last_sent >= self.cfg.link.heartbeat_interval_s:
                regions = list(self._regions_in_use()) if name == self._region_learner else None
                self._send(name, m.Heartbeat(policy_version=p.held_version, regions=regions))
        if self.job is not None and not self.job.done and not self._joined.is_set() and p.admission_due(now):
            # A member not at the rendezvous by now is not waited for (planner.absent).
            self._apply(p.absent(self.group.arrived(p.rendezvous_spec()), now))
        if self.job is not None and self.job.done:
            job, self.job, self._job_buffer = self.job, None, None
            if job.error is not None:  # a bug, not a failed collective: every member counts as failed
                self._apply(p.collective_finished(now, error=f"{type(job.error).__name__}: {job.error}"))
            else:
                self._apply(p.collective_finished(now, result=job.result))
        if self.fanout is not None and now >= self._next_recover:
            self._next_recover = now + self.cfg.sglang.recover_interval_s
            servers = sorted({u for sess in p.sessions.values() for u in sess.servers})
            if servers:  # off this loop, after any push in flight; each server asked again
                self.fanout.recover_soon(servers, again=True)
        self._take_digests(now)
        self._apply(p.tick(now))
        self._tell_regions()
        if self._status_dirty:
            self._write_status()

    def _take_digests(self, now: float) -> None:
        """Hand the held version's digests to the planner once they are computed. Hashing
        failing is a bug, not a peer's fault: it propagates."""
        if self._digest_job is None or not self._digest_job[2].done:
            return
        (version, alg, job), self._digest_job = self._digest_job, None
        self.parts.hashed()  # nothing hashes a receive buffer any more
        if job.error is not None:
            raise RuntimeError(f"hashing the buckets of version {version} failed") from job.error
        held = self.held
        if held is not None and held.version == version and held.region is not None \
                and not held.region.still_valid():  # the learner wrote into it meanwhile: not that version
            self.log.error("region_overwritten", version=version, region=held.region.handle.name,
                           header=str(held.region.header()[1:]), hint="not broadcast; the next version will be")
            return
        self._apply(self.planner.digested(version, job.result, now, alg))

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        return self.planner.status()

    def _write_status(self) -> None:
        self._status_dirty = False
        self.last_status = status = self.status()
        if self.cfg.status_file is None:
            return
        path = Path(self.cfg.status_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(status, sort_keys=True))
        tmp.replace(path)

    def scrape(self, out) -> None:
        """``/metrics`` (``april_async.telemetry``): rounds, their time and bytes, the members' versions
        (as of the last status the loop made: ``broadcaster.json``)."""
        p, status = self.planner, self.last_status
        out.counter("april_broadcaster_rounds_total", "Broadcast rounds ended", p.rounds)
        out.counter("april_broadcaster_failed_rounds_total", "Rounds some member did not complete",
                    p.failed_rounds)
        out.counter("april_broadcaster_bytes_total", "Bytes of the versions broadcast (once per round that "
                    "some member acknowledged)", p.bytes_broadcast)
        out.histogram("april_broadcaster_round_seconds", "Seconds from a round's start to its end",
                      p.round_seconds)
        last = p.last_round
        for phase, key in (("join", "join_s"), ("broadcast", "bcast_s"), ("round", "s")):
            out.gauge("april_broadcaster_last_round_seconds", "The last round's time: joining the group, the "
                      "broadcast itself, the whole round", last.get(key), phase=phase)
        out.gauge("april_broadcaster_last_round_bytes", "The last round's version size", last.get("bytes"))
        out.gauge("april_broadcaster_last_round_members", "Members of the last round", last.get("members"))
        if status:
            out.gauge("april_broadcaster_policy_version", "The version held", status["version"])
            out.gauge("april_broadcaster_published_version", "The newest version some generator holds",
                      status["published"])
            members = status["members"]
            out.gauge("april_broadcaster_members", "Generators with a session", len(members))
            for name, version in sorted(members.items()):
                out.gauge("april_broadcaster_member_version", "The version each generator holds", version,
                          member=name)
