"""One process's place in the weights group: a ``torch.distributed`` group that a ``GroupSpec``
describes, re-formed (a new ``epoch``) whenever the broadcaster's generators change.

- Rank 0 is the broadcaster. It hosts one store for the whole run (the rendezvous store, see
  below; else a ``TCPStore``, ``is_master``); each epoch's rendezvous keys live under
  ``PrefixStore(f"{key_prefix}/epoch-{epoch}", store)``, so the keys of an abandoned epoch (a
  member that registered and died) never meet those of the next one.
- ``join(spec)`` leaves the current group first (if any), then builds the new one.
  ``broadcast(buffer, bucket_bytes, tag=...)`` sends the buffer from rank 0 as consecutive slices
  (``flat.buckets``), one collective each, after a 4-integer header ``[epoch, tag, num_bytes,
  bucket_bytes]``: a member whose own view of the round differs leaves the group and raises
  rather than post receives of the wrong size (gloo answers a size mismatch by aborting the
  whole process, not with an exception). Any failure is a ``GroupError`` and leaves the group.
- Every collective has the spec's ``timeout_s``; the store has it too. A dead member makes rank 0
  fail at once (the connection resets); a member that is alive but does not take part makes it
  fail after ``timeout_s``. A join gives up after ``timeout_s`` (plus ``JOIN_GRACE_S``) even where
  gloo's own connection retries would go on for several times that (see below).
- ``sever()`` cuts the connections the current epoch's join opened (``weights.sockets``), from
  any thread: a collective blocked on a member that a network cut took away fails at once,
  here and then at the members, instead of after ``timeout_s``. Rank 0 does it when a member of a
  running round is found dead.
- Leaving drops the group object: its destructor closes the connections, so the other ranks'
  pending operations fail at once. On torch 2.13 gloo's ``abort()`` and ``shutdown()`` close
  nothing (a member blocked in a receive then waits for its whole timeout), and neither
  interrupts a collective running in another thread; so no reference to the group may outlive a
  failure (``broadcast`` raises outside the ``except`` that caught it, leaving no traceback
  behind). An NCCL group is ``abort()``-ed first (``ncclCommAbort``).
- Backends: ``gloo`` on CPU tensors; ``nccl`` on the CUDA device (``device``; default the current
  one). NCCL needs one GPU per rank: two ranks on one device are refused by NCCL itself. The
  NCCL path is written to the same contract but has not been run (no GPUs where it was written).

Why groups are built as backend objects (``ProcessGroupGloo(store, rank, size, timeout)``)
rather than by re-initialising the default process group — both were tried on torch 2.13 (CPU,
gloo): ``destroy_process_group()`` then ``init_process_group(store=PrefixStore(...))`` does work
when every process re-initialises in lock step, but the default group's store keys carry a
process-local counter (``_world.group_count``, e.g. ``epoch-4/1//cpu//0/1``) that a *failed*
``init_process_group`` (a member that never came) bumps without resetting. After one failed
rendezvous the broadcaster waits on ``epoch-E/1/...`` while a freshly started generator
registers under ``epoch-E/0/...``, and no later epoch ever meets. The default group is also
process-global state, which an engine that itself uses ``torch.distributed`` would lose. Backend
objects have neither problem: the keys are exactly ``epoch-E/<rank>``, and re-joining with any
world size and rank works (tried: the same group twice, shrink 3 → 2 ranks, grow 2 → 3, a member
SIGKILLed mid-epoch, a member that never joins, a member that joins and never broadcasts).
Groups should be left (``close``) before the interpreter exits: one left to the interpreter's
teardown after a failed collective sometimes ends the process with ``std::terminate``.

The rendezvous (``weights.zstore``): a broadcaster hosted with a ``rendezvous_port`` also runs a
``StoreService``, a ZeroMQ store secured like the hubs (CurveZMQ with the run's keys), and fills
``GroupSpec.rendezvous`` with its endpoint; every rank of such a group, rank 0 included, meets the
others through a ``ZmqStore`` client of it, never through the TCPStore. The keys of an epoch are
deleted from it when rank 0 leaves that epoch (not when the group forms: a member may still be
reading another member's address then, and NCCL exchanges its id at the first collective). A
spec without ``rendezvous`` (a broadcaster hosted without one) uses the TCPStore as before. The
TCPStore itself stays up for SGLang's weight-update group alone (``broadcaster.sglang``): SGLang
servers cannot speak the ZeroMQ channel, so that group's rendezvous remains open to whoever
reaches the store port (SPEC, known weaknesses 1).

Across hosts (``weights.routes``): every rank advertises the address of its interface that routes
to the store's host (rank 0: the address the store is bound to), not what the host name resolves
to (often 127.0.0.1: the others would connect to themselves). The store listens on that one
address, not on every interface. Every key of a group lives under the spec's ``key_prefix``, a
per-run secret the broadcaster hands out over the authenticated ZeroMQ channel, so a process that
can reach the store's port but is not of the run cannot register as a rank. Forming a group is
bounded by ``timeout_s`` whatever gloo does: gloo's own connection retries can outlast it several
times over (282 s seen with ``timeout_s = 60``), so the constructor runs in a thread that is
abandoned (and its group dropped when it ends) once the time is up.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from april_async.weights import sockets
from april_async.weights.flat import buckets
from april_async.weights.zstore import StoreService, ZmqStore
from april_async.weights.routes import RouteError, check_local, gloo_device, route_address, set_nccl_interface
from april_async.logs import get_logger
from april_async.wire.messages import GroupSpec

HEADER_LEN = 4  # [epoch, tag, num_bytes, bucket_bytes]
RETIRED_CLIENTS = 4  # closed rendezvous clients kept alive for abandoned joins (see ``_drop_zstore``)
JOIN_GRACE_S = 2.0
"""How long past ``timeout_s`` a join may take before it is abandoned: the store's and gloo's own
waits end at ``timeout_s``, and a failure they raise then is the better message."""


class GroupError(RuntimeError):
    """A rendezvous, a collective or a store operation of the weights group failed or timed out."""


def parse_store(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); a bad address is a ``ValueError`` naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class WeightGroup:
    """This process's membership of the weights group (at most one epoch at a time)."""

    def __init__(self, *, device: torch.device | str | None = None, store: dist.TCPStore | None = None,
                 store_host: str | None = None, address: str | None = None, keys: Path | None = None,
                 service: StoreService | None = None, rendezvous: str | None = None):
        """``address``: the address this rank advertises to the others (default: found, see
        ``weights.routes``); it must be one of this host's. ``keys``: the keys directory of this
        process's link, with which it reaches a rendezvous store (``weights.zstore``). ``service``
        and ``rendezvous``: rank 0's own rendezvous store and the endpoint members reach it at."""
        self.device = torch.device(device) if device is not None else None
        self.keys = Path(keys) if keys is not None else None
        self._service = service
        self._rendezvous = rendezvous
        self._zstore: ZmqStore | None = None  # the client of the rendezvous store in use (ZeroMQ reconnects it)
        self._retired: list[ZmqStore] = []  # closed clients an abandoned join may still call: kept alive
        self._zlock = threading.Lock()
        self.spec: GroupSpec | None = None
        self._store = store  # rank 0: the master store of the run; members: a client, per address
        self._store_address = f"{store_host}:{store.port}" if store is not None else None
        self._store_host = store_host
        self.address = check_local(address) if address else None
        self._pg = None
        self._nccl_group = False
        self._links: set[int] = set()  # socket inodes the current epoch's join opened (``sever``)
        self._joining: GroupSpec | None = None  # the spec a join in progress forms
        self.keep_ports: set[int] = set()
        """Ports of this process's other connections (its hubs, its broker link): never cut by ``sever``."""
        self.log = get_logger(component="weight_group")

    @classmethod
    def host(cls, host: str, port: int, timeout_s: float, *, device=None, address: str | None = None,
             rendezvous_port: int | None = None, keys: Path | None = None, allow_open: bool = False) -> WeightGroup:
        """Rank 0: start the run's TCPStore on ``host:port`` (0: any free port) and return its
        group. The store listens on ``host`` alone (``0.0.0.0``/``::``: every interface). With
        ``rendezvous_port`` (0: any free port) it also starts the rendezvous store on ``host``,
        secured with ``keys`` like the hubs (without keys: loopback only, unless ``allow_open``)."""
        store = cls._tcp_store(host, port, timeout_s)
        if rendezvous_port is None:
            return cls(device=device, store=store, store_host=host, address=address, keys=keys)
        try:
            service = StoreService(f"tcp://{_bind_host(host)}:{rendezvous_port}", keys=keys, allow_open=allow_open)
        except Exception as e:  # KeysError (an open bind refused, bad keys), StoreError (the port is taken)
            raise GroupError(f"cannot start the rendezvous store on {host}:{rendezvous_port}: {e}") from e
        return cls(device=device, store=store, store_host=host, address=address, keys=keys, service=service,
                   rendezvous=f"tcp://{_bracketed(host)}:{service.port}")

    @staticmethod
    def _tcp_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
        try:
            listener = _listen(host, port)
        except OSError as e:
            raise GroupError(f"cannot listen for the TCPStore on {host}:{port}: {e}") from e
        try:
            store = dist.TCPStore(host, listener.getsockname()[1], None, True,
                                  timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                  master_listen_fd=listener.fileno())
        except Exception as e:  # torch raises DistNetworkError (a RuntimeError)
            listener.close()
            raise GroupError(f"cannot start the TCPStore on {host}:{port}: {e}") from e
        listener.detach()  # the store owns the descriptor now
        return store

    @property
    def store(self) -> dist.TCPStore | None:
        """The TCPStore this process hosts (rank 0) or is connected to; other groups may share it
        under their own key prefix (``weights.custom_group``)."""
        return self._store

    @property
    def rendezvous(self) -> str | None:
        """The endpoint of the rendezvous store this process hosts (rank 0 hosted with a
        ``rendezvous_port``), for ``GroupSpec.rendezvous``; else None."""
        return self._rendezvous

    @property
    def store_address(self) -> str | None:
        """``host:port`` of the store this process hosts (rank 0), else None."""
        return self._store_address

    @property
    def epoch(self) -> int | None:
        return self.spec.epoch if self.spec is not None else None

    # ------------------------------------------------------------------ membership

    def join(self, spec: GroupSpec) -> None:
        """Leave the current group, if any, and join ``spec``'s (blocks until every rank came)."""
        self.leave()
        t0 = time.monotonic()
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self._joining = spec
        try:
            store = self._store_for(spec)
            prefixed = dist.PrefixStore(_prefix(spec), store)
            address = self.local_address(spec)
            if spec.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout, opts._devices = timeout, [gloo_device(address)]
                make = lambda: dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, opts)  # noqa: E731
            else:
                if address is not None:
                    set_nccl_interface(address)
                make = lambda: self._nccl(prefixed, spec, timeout)  # noqa: E731
            before = sockets.tcp_sockets()
            pg = _bounded(make, spec.timeout_s + JOIN_GRACE_S, f"forming epoch {spec.epoch}")
        except Exception as e:  # DistStoreError, gloo's RuntimeError: a member that did not come
            if spec.rank and not spec.rendezvous:  # the store may be gone (a restarted broadcaster): reconnect
                self._store, self._store_address = None, None
            if isinstance(e, GroupError):
                raise
            raise GroupError(f"joining epoch {spec.epoch} as rank {spec.rank} of {spec.world_size} failed after "
                             f"{time.monotonic() - t0:.1f} s: {_short(e)}") from e
        finally:
            self._joining = None
        self._pg, self.spec, self._nccl_group = pg, spec, spec.backend == "nccl"
        keep = self.keep_ports | {p for p in (self._service.port if self._service else None,
                                              self._store.port if self._store is not None else None) if p}
        self._links = {inode for inode, ports in sockets.tcp_sockets().items()
                       if inode not in before and not keep.intersection(ports)}
        self.log.debug("joined", epoch=spec.epoch, rank=spec.rank, world_size=spec.world_size,
                       s=round(time.monotonic() - t0, 3))

    def local_address(self, spec: GroupSpec) -> str | None:
        """The address this rank advertises: the configured one; rank 0, the store's own bind
        address; a member, its local end of the route to the store. None: gloo's default (the host
        name's address), only where rank 0's store listens on every interface."""
        if self.address:
            return self.address
        if spec.rank == 0:
            host = self._store_host
            return None if host is None or _unspecified(host) else host
        try:
            return route_address(parse_store(spec.store)[0])
        except RouteError as e:
            raise GroupError(str(e)) from None

    def _store_for(self, spec: GroupSpec) -> dist.Store:
        """The store this rank meets the others through: the rendezvous store when the spec names
        one (rank 0: as a client of its own service), else the TCPStore."""
        if spec.rendezvous:
            return self._rendezvous_store(spec)
        if spec.rank:
            return self._client_store(spec)
        if self._store is None:
            raise GroupError(f"rank 0 of epoch {spec.epoch} needs the store this process hosts")
        return self._store

    def _rendezvous_store(self, spec: GroupSpec) -> ZmqStore:
        endpoint = spec.rendezvous
        if spec.rank == 0:
            if self._service is None:
                raise GroupError(f"rank 0 of epoch {spec.epoch} names the rendezvous store {endpoint!r}, but this "
                                 f"process hosts none (WeightGroup.host(..., rendezvous_port=...))")
            endpoint = _dialable(self._service.endpoint)
        if self._zstore is None or self._zstore.endpoint != endpoint:
            self._drop_zstore()
            self._zstore = ZmqStore(endpoint, keys=self.keys, timeout_s=spec.timeout_s)
        self._zstore.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
        return self._zstore

    def _drop_zstore(self) -> None:
        """Close the rendezvous client, but keep the object: a join abandoned by ``_bounded`` may
        still call it from C++ (it then gets a ``StoreError``, not a freed Python object)."""
        with self._zlock:  # ``abandon`` drops it from another thread
            zstore, self._zstore = self._zstore, None
            if zstore is not None:
                zstore.close()
                self._retired = [*self._retired[-(RETIRED_CLIENTS - 1):], zstore]

    def _client_store(self, spec: GroupSpec) -> dist.TCPStore:
        if self._store is None or self._store_address != spec.store:
            host, port = parse_store(spec.store)
            self._store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=spec.timeout_s))
            self._store_address = spec.store
        return self._store

    def _nccl(self, store, spec: GroupSpec, timeout: datetime.timedelta):
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise GroupError(f"epoch {spec.epoch} uses nccl, which this torch build or machine does not have")
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.global_ranks_in_group = list(range(spec.world_size))
        opts.group_name = f"april-weights-epoch-{spec.epoch}"
        return dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, opts)

    def arrived(self, spec: GroupSpec) -> set[int] | None:
        """Rank 0: the ranks whose key is in the rendezvous of ``spec``'s epoch so far (a gloo rank
        registers ``<prefix>/0/<rank>`` as it starts to join); None where that cannot be told
        (no rendezvous store of its own, or another backend)."""
        if self._service is None or spec.backend != "gloo" or not spec.rendezvous:
            return None
        ranks = set()
        for key in self._service.keys_under(_prefix(spec) + "/"):
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                ranks.add(int(tail))
        return ranks

    def sever(self) -> int:
        """Cut the current epoch's connections (see the module docstring), and on rank 0 give up
        the rendezvous of an epoch being formed (its waits fail at once, ``StoreService.cancel``);
        how many connections were cut."""
        joining = self._joining
        if joining is not None and joining.rank == 0 and joining.rendezvous and self._service is not None:
            self._service.cancel(_prefix(joining) + "/")
        return sockets.sever(set(self._links))

    def abandon(self) -> None:
        """From any thread: give up whatever this process's group is doing for a broadcaster that
        is gone (a member whose broadcaster restarted): cut the current epoch's connections and
        close the rendezvous client, so that a join waiting at the dead one's rendezvous fails now
        (``ZmqStore.close``) instead of after ``timeout_s``, and a receive fails at once. The next
        join connects afresh."""
        self.sever()
        self._drop_zstore()

    def leave(self) -> None:
        """Leave the current group: drop this process's group object, whose destructor closes its
        connections, so that the other ranks' pending operations fail at once. (``abort()`` and
        ``shutdown()`` do not close them on torch 2.13: the others then wait for their timeout.)"""
        pg, spec, self._pg, self.spec = self._pg, self.spec, None, None
        self._links = set()
        if pg is not None and self._nccl_group:
            pg.abort()  # NCCL: abort the communicator, whose plain destruction can wait on a dead peer
        self._nccl_group = False
        if spec is not None and spec.rank == 0 and spec.rendezvous and self._service is not None:
            self._service.forget(_prefix(spec) + "/")  # nobody meets under this epoch again

    def close(self) -> None:
        """Leave, and stop the stores (rank 0) or drop the connections to them (a member may join
        again afterwards: its next ``join`` connects afresh)."""
        self.leave()
        self._store = None
        self._drop_zstore()
        service, self._service = self._service, None
        if service is not None:
            service.close()

    # ------------------------------------------------------------------ data

    def buffer_device(self) -> torch.device:
        """Where a buffer must live for this group's backend."""
        if self.spec is not None and self.spec.backend == "nccl":
            if self.device is not None and self.device.type == "cuda":
                return self.device
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, buffer: torch.Tensor, bucket_bytes: int, *, tag: int = 0) -> None:
        """Rank 0 sends ``buffer`` (1-D uint8) to every rank, ``bucket_bytes`` at a time; the
        others receive into theirs. ``tag`` (the version) goes in the header, checked by members."""
        spec = self.spec
        if spec is None or self._pg is None:
            raise GroupError("broadcast outside a group: join one first")
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"the buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} "
                             f"{tuple(buffer.shape)}")
        failure = self._run(spec, buffer, bucket_bytes, tag)
        if failure is not None:
            # The connections are cut first: the other ranks' receives fail now, whatever keeps
            # gloo's group alive a while (issue 42: rank 0 failed at the header on a dead member's
            # closed connection, left the group, and a healthy member still waited out its timeout).
            # Raised here, outside the ``except`` that caught it: nothing (no traceback, no
            # ``__context__``) keeps the process group alive, so ``leave`` really closes it.
            self.sever()
            self.leave()
            raise GroupError(failure)

    def _run(self, spec: GroupSpec, buffer: torch.Tensor, bucket_bytes: int, tag: int) -> str | None:
        """The header, then every bucket; the reason of the first failure, or None."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        expect = [spec.epoch, tag, buffer.numel(), bucket_bytes]
        header = torch.tensor(expect if spec.rank == 0 else [0] * HEADER_LEN, dtype=torch.int64, device=buffer.device)
        where = f"epoch {spec.epoch} (rank {spec.rank} of {spec.world_size})"
        step = "header"
        try:
            self._collective(header, timeout)
            got = header.tolist()
            if got != expect:
                return (f"{where}: rank 0 sends [epoch, tag, bytes, bucket] {got} but this rank expected {expect}; "
                        f"leaving the group")
            for start, stop in buckets(buffer.numel(), bucket_bytes):
                step = f"bytes {start}:{stop}"
                self._collective(buffer[start:stop], timeout)
        except Exception as e:  # gloo's RuntimeError (a reset connection, a timeout), NCCL's errors
            return f"broadcast in {where} failed at {step}: {_short(e)}"
        return None

    def _collective(self, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
        work = self._pg.broadcast(tensor, 0, timeout)
        if tensor.is_cuda:
            work.wait(timeout)  # NCCL: block this thread until done, or raise after the timeout
        else:
            work.wait()  # gloo: the operation's own timeout applies


def _prefix(spec: GroupSpec) -> str:
    """Where an epoch's keys live: under the run's secret when the spec carries one (1.6)."""
    return f"{spec.key_prefix}/epoch-{spec.epoch}" if spec.key_prefix else f"epoch-{spec.epoch}"


def _bracketed(host: str) -> str:
    """``host`` as it goes into a ``tcp://`` endpoint (an IPv6 address in brackets)."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def _bind_host(host: str) -> str:
    """``host`` as ZeroMQ binds it: an address (ZeroMQ binds interfaces, not host names)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        host = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    return _bracketed(host)


def _dialable(endpoint: str) -> str:
    """Rank 0's own way to its service: a bind on every interface (``0.0.0.0``, ``::``) is dialled
    on loopback, which it listens on too."""
    head, _, port = endpoint.rpartition(":")
    host = head.split("://", 1)[1]
    if not _unspecified(host):
        return endpoint
    return f"tcp://{'[::1]' if ':' in host.strip('[]') else '127.0.0.1'}:{port}"


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` for the TCPStore to take over (torch's own store
    listens on every interface; this one listens where it is told)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def _bounded(make, limit_s: float, what: str):
    """``make()`` in a thread (the group constructors release the GIL); a ``GroupError`` if it has
    not returned within ``limit_s``. The abandoned call goes on until gloo gives up; whatever it
    builds then is dropped at once, so its connections close and its peers fail fast."""
    result: dict = {}
    lock = threading.Lock()  # the hand-over and the abandoning exclude each other
    done = threading.Event()

    def run():
        try:
            value = ("pg", make())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            value = ("error", e)
        with lock:
            if not result.get("abandoned"):
                result[value[0]] = value[1]
            done.set()
        del value

    threading.Thread(target=run, name=f"weights-join ({what})", daemon=True).start()
    if not done.wait(limit_s):
        with lock:
            if not done.is_set():
                result["abandoned"] = True
                raise GroupError(f"{what} did not finish within {limit_s:g} s (a member unreachable at the "
                                 f"address it advertised?); abandoned")
    if "error" in result:
        raise result.pop("error")
    return result.pop("pg")


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
