"""The weights group's rendezvous store, reached only over the authenticated ZeroMQ channel.

Why: torch's ``TCPStore`` admits anyone who reaches its port and lists its keys to any client
(``list_keys``, torch 2.13), so the run's secret key prefix (``GroupSpec.key_prefix``) can be read
off it and a stranger can register as a rank of an epoch being formed. This store is what the
broadcaster hosts instead for groups of ``torch``-engine members (``GroupSpec.rendezvous``):

- ``StoreService``: a thread of the broadcaster's process with a ROUTER socket secured exactly
  like the hubs (``transport.curve.serve``: with keys only admitted clients get in; without keys
  it binds loopback only unless ``allow_open``). It keeps a key → bytes table and answers the
  operations gloo's and NCCL's rendezvous use (``OPS``). There is deliberately no operation that
  lists keys. Blocking operations (``get``, ``wait``) never block the thread: they are parked as
  waiters and answered when their keys arrive, or with a ``timeout`` error at their deadline. A
  frame that does not decode, an unknown operation, an argument of the wrong type: answered with
  an error and logged; the thread goes on serving.
- ``ZmqStore``: a ``torch.distributed.Store`` whose operations are requests to the service over a
  DEALER socket (a CURVE client with the run's keys), one at a time, each bounded by the store's
  timeout: a service that does not answer, or refuses this process's key, raises a ``StoreError``
  naming the endpoint; it never hangs.

SGLang's weight-update group still meets on the TCPStore (SGLang servers cannot speak this
channel): that rendezvous stays open to whoever reaches the store port (SPEC, known weaknesses 1).

The wire format (``proto/SPEC.md``, "The rendezvous store"): one MessagePack frame each way,

    request  [request_id: int, op: str, key: str | list[str] | nil, arg]
    reply    [request_id: int, ok: bool, result]       (not ok: result = [code: str, text: str])

with ``arg`` by operation: ``set``/``append`` the value (bin); ``get``/``wait`` the timeout in ms;
``add`` the amount (int); ``compare_set`` ``[expected, desired]`` (bin, bin); otherwise nil.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch.distributed as dist
import zmq

from april_async.logs import get_logger
from april_async.transport import curve

MAX_FRAME_BYTES = 1 << 20
"""The largest request or reply (1 MiB): rendezvous values are addresses and NCCL ids, bytes long.
The socket drops a peer that sends more (``ZMQ_MAXMSGSIZE``)."""
MAX_VALUE_BYTES = MAX_FRAME_BYTES // 2  # one key's value, appends included
MAX_KEYS = 1 << 16  # keys the table holds at once: a client cannot make the service grow unbounded
MAX_WAITERS = 1 << 12  # parked get/wait requests at once
MAX_KEYS_PER_REQUEST = 1 << 10  # keys named by one check/wait
MAX_WAIT_MS = 24 * 3600 * 1000  # the longest get/wait a client may ask for (a day)
MAX_BATCH = 256  # requests answered before deadlines are looked at again
TICK_S = 0.05  # the service thread's longest sleep: how soon it notices ``close`` and deadlines
CLOSE_POLL_MS = 200  # a client's longest wait between looks at ``close``: how soon a closed client's
                     # request ends
REPLY_GRACE_S = 2.0
"""How long a client waits past a blocking operation's own timeout: the service answers a timed-out
waiter itself, and its typed ``timeout`` reply is the better message than "no answer"."""

OPS = ("set", "get", "add", "compare_set", "append", "check", "wait", "delete_key", "num_keys")
"""What the service answers. gloo's rendezvous uses set, wait and get (torch 2.13, seen by running
it); NCCL's is expected to use set and get (its unique id) and, from its monitor thread, check,
but has not been run over this store (no GPUs where it was written); the rest complete
``torch.distributed.Store``, so that whatever else a backend calls is answered, not refused."""


class StoreError(RuntimeError):
    """A rendezvous store operation failed: refused, unanswered, or answered with an error."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class StoreTimeout(StoreError):
    """A ``get``/``wait`` whose keys did not all arrive before its deadline."""

    def __init__(self, message: str):
        super().__init__(message, "timeout")


class BadRequest(ValueError):
    """A request the service cannot act on; answered to the client with ``code`` and the message
    (and with the request's id when it could be read)."""

    def __init__(self, code: str, message: str, request_id: int | None = None):
        super().__init__(message)
        self.code, self.request_id = code, request_id


# ---------------------------------------------------------------------------------------------
# The wire format


def encode_request(request_id: int, op: str, key, arg=None) -> bytes:
    return msgpack.packb([request_id, op, key, arg], use_bin_type=True)


def encode_reply(request_id: int | None, ok: bool, result) -> bytes:
    return msgpack.packb([request_id, ok, result], use_bin_type=True)


@dataclass(frozen=True)
class Request:
    request_id: int
    op: str
    key: str | list[str] | None
    arg: object


def decode_request(payload: bytes) -> Request:
    """A typed request, or ``BadRequest`` naming what is wrong (the request id is then unknown)."""
    try:
        value = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for bad bytes: all mean "malformed"
        raise BadRequest("malformed", f"the request is not MessagePack: {e}") from None
    if not isinstance(value, list) or len(value) != 4:
        raise BadRequest("malformed", f"a request is [request_id, op, key, arg], got {_short(value)}")
    request_id, op, key, arg = value
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise BadRequest("malformed", f"request_id must be an int, got {_short(request_id)}")
    if op not in OPS:
        raise BadRequest("unknown_op", f"unknown op {_short(op)}; the store answers {', '.join(OPS)}", request_id)
    return Request(request_id, op, key, arg)


def decode_reply(payload: bytes) -> tuple[int | None, bool, object]:
    value = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(value, list) or len(value) != 3 or not isinstance(value[1], bool):
        raise StoreError(f"a reply is [request_id, ok, result], got {_short(value)}", "malformed")
    return value[0], value[1], value[2]


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The table: the store's state and its non-blocking operations, no I/O


def _key(key) -> str:
    if not isinstance(key, str):
        raise BadRequest("bad_type", f"key must be a str, got {_short(key)}")
    return key


def _keys(keys) -> list[str]:
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BadRequest("bad_type", f"keys must be a list of str, got {_short(keys)}")
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise BadRequest("too_large", f"{len(keys)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    return keys


def _bytes(value, what: str = "value") -> bytes:
    if not isinstance(value, bytes):
        raise BadRequest("bad_type", f"{what} must be bin, got {_short(value)}")
    return value


def _timeout_ms(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_WAIT_MS:
        raise BadRequest("bad_type", f"timeout_ms must be an int in 1..{MAX_WAIT_MS}, got {_short(value)}")
    return value


class Table:
    """Key → bytes, with the store's semantics (those of torch's ``TCPStore``)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def has(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def _put(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise BadRequest("too_large", f"a value of {len(value)} bytes for {key!r}; the limit is {MAX_VALUE_BYTES}")
        if key not in self.data and len(self.data) >= MAX_KEYS:
            raise BadRequest("full", f"the store holds {MAX_KEYS} keys already; {key!r} refused")
        self.data[key] = value

    def apply(self, req: Request):
        """The result of a non-blocking operation (``get``/``wait`` only when their keys are here)."""
        op, key, arg = req.op, req.key, req.arg
        if op == "set":
            return self._put(_key(key), _bytes(arg))
        if op == "get":
            return self.data[_key(key)]
        if op == "append":
            key = _key(key)
            return self._put(key, self.data.get(key, b"") + _bytes(arg))
        if op == "add":
            return self._add(_key(key), arg)
        if op == "compare_set":
            return self._compare_set(_key(key), arg)
        if op == "check":
            return self.has(_keys(key))
        if op == "wait":
            return None
        if op == "delete_key":
            return self.data.pop(_key(key), None) is not None
        if op == "num_keys":
            return len(self.data)
        raise BadRequest("unknown_op", f"unknown op {op!r}")

    def _add(self, key: str, amount) -> int:
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise BadRequest("bad_type", f"add's amount must be an int, got {_short(amount)}")
        current = self.data.get(key, b"0")
        try:
            value = int(current.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise BadRequest("bad_value", f"{key!r} holds {_short(current)}, not an integer to add to") from None
        self._put(key, str(value).encode())
        return value

    def _compare_set(self, key: str, arg) -> bytes:
        """Set ``desired`` if the value is ``expected`` (a missing key counts as ``b""``); return
        the value the key has afterwards (a missing key that stays missing: ``expected``)."""
        if not isinstance(arg, list) or len(arg) != 2:
            raise BadRequest("bad_type", f"compare_set's arg must be [expected, desired], got {_short(arg)}")
        expected, desired = _bytes(arg[0], "expected"), _bytes(arg[1], "desired")
        current = self.data.get(key)
        if current is None and expected != b"":
            return expected
        if current is None or current == expected:
            self._put(key, desired)
            return desired
        return current

    def forget(self, prefix: str) -> int:
        doomed = [k for k in self.data if k.startswith(prefix)]
        for k in doomed:
            del self.data[k]
        return len(doomed)


# ---------------------------------------------------------------------------------------------
# The service


@dataclass
class Waiter:
    """A parked ``get``/``wait``: answered when all ``keys`` are in, or at ``deadline``."""

    identity: bytes
    request: Request
    keys: list[str]
    deadline: float


class StoreService:
    """The rendezvous store's server: a thread of the broadcaster's process (see the module doc)."""

    def __init__(self, bind: str, *, keys: Path | None = None, allow_open: bool = False,
                 ctx: zmq.Context | None = None, clock=time.monotonic):
        self.clock = clock
        self.ctx = ctx or zmq.Context.instance()
        self.log = get_logger(component="rendezvous_store")
        self.table = Table()
        self.waiters: list[Waiter] = []
        self.counters = {"requests": 0, "errors": 0, "auth_refused": 0}
        self._lock = threading.Lock()  # the table: this thread, and ``forget`` from the owner's
        self._cancelled: set[str] = set()  # key prefixes whose waits fail (``cancel``)
        self._stop = threading.Event()
        self.refusals = curve.RefusalLog(self.log, self.clock)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.secure = curve.serve(self.sock, self.ctx, keys, bind, allow_open=allow_open)
        self.monitor = curve.HandshakeMonitor(self.sock) if self.secure else None
        try:
            self.endpoint = curve.bind(self.sock, bind)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise StoreError(f"cannot bind the rendezvous store on {bind}: {e}", "bind") from None
        self._thread = threading.Thread(target=self._run, name=f"rendezvous-store {self.endpoint}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def forget(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (an epoch left behind); the number deleted. For the
        owner's thread: no client can do this (nor learn which keys there are)."""
        with self._lock:
            return self.table.forget(prefix)

    def keys_under(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` now (who reached an epoch's rendezvous). For the owner's
        thread: no client can list keys."""
        with self._lock:
            return [k for k in self.table.data if k.startswith(prefix)]

    def cancel(self, prefix: str) -> None:
        """Fail every wait for keys under ``prefix`` now, and every later one at once (code
        ``cancelled``): rank 0 gives up forming an epoch whose member went dark, and the members
        already waiting there are let go rather than held for their whole timeout. For the
        owner's thread; the service's thread answers the waiters at its next step."""
        with self._lock:
            self._cancelled.add(prefix)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self.sock.closed:
            return
        if self.monitor is not None:
            self.monitor.close()
        self.sock.close(linger=0)

    # ------------------------------------------------------------------ the service's thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:  # the context is being terminated: the process is ending
                    return
                self.log.exception("store_loop_failed")
                time.sleep(TICK_S)  # a failure that repeats must not spin
            except Exception:  # noqa: BLE001 - a bug must not take the rendezvous down with it
                self.log.exception("store_loop_failed")
                time.sleep(TICK_S)

    def _step(self) -> None:
        """Log refusals, answer what came in, then answer the waiters whose time is up."""
        if self.monitor is not None:
            self._refusals()
        if self.sock.poll(int(self._sleep_s() * 1000)):
            for _ in range(MAX_BATCH):
                try:
                    frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._serve(frames)
        self._expire(self.clock())
        self._cancel_waiters()

    def _cancel_waiters(self) -> None:
        with self._lock:
            cancelled = tuple(self._cancelled)
        if not cancelled or not self.waiters:
            return
        doomed = [w for w in self.waiters if any(k.startswith(cancelled) for k in w.keys)]
        if doomed:
            gone = {id(w) for w in doomed}
            self.waiters = [w for w in self.waiters if id(w) not in gone]
            for w in doomed:
                self._error(w.identity, w.request.request_id, "cancelled",
                            f"{w.request.op}: the epoch was given up by rank 0")

    def _sleep_s(self) -> float:
        if not self.waiters:
            return TICK_S
        return max(0.0, min(TICK_S, min(w.deadline for w in self.waiters) - self.clock()))

    def _serve(self, frames: list[bytes]) -> None:
        """Answer one message; nothing a client sends ends the thread."""
        identity, request_id = frames[0], None
        self.counters["requests"] += 1
        try:
            if len(frames) != 2:
                raise BadRequest("malformed", f"a request is one frame, got {len(frames) - 1}")
            req = decode_request(frames[1])
            request_id = req.request_id
            self._handle(identity, req)
        except BadRequest as e:
            self._error(identity, request_id if e.request_id is None else e.request_id, e.code, str(e))
        except Exception as e:  # noqa: BLE001 - a bug must not take the rendezvous down with it
            self.log.exception("store_request_failed", request_id=request_id)
            self._error(identity, request_id, "internal", f"{type(e).__name__}: {e}")

    def _handle(self, identity: bytes, req: Request) -> None:
        if req.op in ("get", "wait"):
            keys = [_key(req.key)] if req.op == "get" else _keys(req.key)
            timeout_ms = _timeout_ms(req.arg)
            with self._lock:
                if self.table.has(keys):
                    return self._answer(identity, req)
                if self._cancelled and any(k.startswith(tuple(self._cancelled)) for k in keys):
                    raise BadRequest("cancelled", f"{req.op}: the epoch was given up by rank 0")
            if len(self.waiters) >= MAX_WAITERS:
                raise BadRequest("full", f"{MAX_WAITERS} requests are waiting already")
            self.waiters.append(Waiter(identity, req, keys, self.clock() + timeout_ms / 1000))
            return None
        with self._lock:
            result = self.table.apply(req)
        self._reply(identity, req.request_id, True, result)
        if req.op in ("set", "append", "add", "compare_set"):
            self._wake()
        return None

    def _answer(self, identity: bytes, req: Request) -> None:
        """Answer a get/wait whose keys are all in (call under the lock)."""
        self._reply(identity, req.request_id, True, self.table.apply(req))

    def _wake(self) -> None:
        with self._lock:
            ready = {id(w) for w in self.waiters if self.table.has(w.keys)}
            for w in self.waiters:
                if id(w) in ready:
                    self._answer(w.identity, w.request)
        if ready:
            self.waiters = [w for w in self.waiters if id(w) not in ready]

    def _expire(self, now: float) -> None:
        late = [w for w in self.waiters if w.deadline <= now]
        if not late:
            return
        self.waiters = [w for w in self.waiters if w.deadline > now]
        with self._lock:  # one hold: ``forget`` must not take a key between the look and the answer
            for w in late:
                missing = [k for k in w.keys if k not in self.table.data]
                if not missing:  # its keys came in this very tick: an answer beats a timeout
                    self._answer(w.identity, w.request)
                    continue
                self._error(w.identity, w.request.request_id, "timeout",
                            f"{w.request.op}: {len(missing)} of {len(w.keys)} keys did not arrive within "
                            f"{w.request.arg} ms")

    def _reply(self, identity: bytes, request_id: int | None, ok: bool, result) -> None:
        try:
            self.sock.send_multipart([identity, encode_reply(request_id, ok, result)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the client is gone, or its queue is full: it times out on its own
            pass

    def _error(self, identity: bytes, request_id: int | None, code: str, text: str) -> None:
        self.counters["errors"] += 1
        if code not in ("timeout", "cancelled"):  # a waiter timed out or let go is the client's business
            self.log.warning("store_request_refused", code=code, request_id=request_id, error=text)
        self._reply(identity, request_id, False, [code, text])

    def _refusals(self) -> None:
        """Count and log refused handshakes (``curve.RefusalLog``)."""
        for event in self.monitor.events():
            self.counters["auth_refused"] += 1
            self.refusals.note(event)


# ---------------------------------------------------------------------------------------------
# The client


def _as_bytes(value) -> bytes:
    """A value as torch or a caller passes it (bytes from C++; str or a list of ints from Python)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple)):
        try:
            return bytes(value)
        except (TypeError, ValueError):
            raise TypeError(f"a store value given as a list must hold ints in 0..255, got {_short(value)}") from None
    raise TypeError(f"a store value must be bytes, str or a list of ints, got {type(value).__name__}")


def _seconds(timeout) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class ZmqStore(dist.Store):
    """A ``torch.distributed.Store`` whose every operation is a request to a ``StoreService``."""

    def __init__(self, endpoint: str, *, keys: Path | None = None, timeout_s: float = 60.0,
                 ctx: zmq.Context | None = None):
        super().__init__()
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()  # one request at a time: the socket is not thread-safe
        self._ids = itertools.count(1)
        self._closing = False
        ctx = ctx or zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.secure = curve.connect(self.sock, keys)
        self.monitor = curve.HandshakeMonitor(self.sock)
        self.sock.connect(endpoint)

    def close(self) -> None:
        """Close the socket; never waits for a request in flight (an abandoned join's): that
        request's own thread closes it when it ends, within a second (``_wait`` looks at the flag
        between its polls, and raises ``StoreError`` code ``closed``)."""
        self._closing = True
        if self._lock.acquire(blocking=False):
            try:
                self._close_sockets()
            finally:
                self._lock.release()

    def _close_sockets(self) -> None:
        if self.sock is not None:
            self.monitor.close()
            self.sock.close(linger=0)
            self.sock = self.monitor = None

    # ------------------------------------------------------------------ torch.distributed.Store

    def set(self, key, value) -> None:
        self._call("set", key, _as_bytes(value))

    def get(self, key) -> bytes:
        return self._call("get", key, self._ms(None), wait_s=self.timeout_s)

    def add(self, key, amount) -> int:
        return self._call("add", key, int(amount))

    def append(self, key, value) -> None:
        self._call("append", key, _as_bytes(value))

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._call("compare_set", key, [_as_bytes(expected_value), _as_bytes(desired_value)])

    def check(self, keys) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None) -> None:
        seconds = _seconds(timeout) or self.timeout_s
        self._call("wait", list(keys), self._ms(seconds), wait_s=seconds)

    def delete_key(self, key) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys", None)

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def set_timeout(self, timeout) -> None:
        seconds = _seconds(timeout)
        if seconds:  # torch's "no timeout" (0) would let a rendezvous hang: keep the one we have
            self.timeout_s = seconds

    def list_keys(self):
        raise StoreError(f"the rendezvous store at {self.endpoint} lists no keys, by design", "unsupported")

    # ------------------------------------------------------------------ requests

    def _ms(self, seconds: float | None) -> int:
        return max(1, min(MAX_WAIT_MS, int((seconds or self.timeout_s) * 1000)))

    def _call(self, op: str, key, arg=None, *, wait_s: float | None = None):
        """Send one request and return its result; the deadline is the store's timeout (a blocking
        op's own, plus ``REPLY_GRACE_S`` for the service's answer to it)."""
        limit_s = (wait_s + REPLY_GRACE_S) if wait_s is not None else self.timeout_s
        with self._lock:
            if self.sock is None or self._closing:
                self._close_sockets()
                raise StoreError(f"the client of the rendezvous store at {self.endpoint} is closed", "closed")
            try:
                ok, result = self._request(op, key, arg, limit_s)
            finally:
                if self._closing:  # closed while this request was in flight
                    self._close_sockets()
        if ok:
            return result
        code, text = result if isinstance(result, list) and len(result) == 2 else ("error", repr(result))
        message = f"rendezvous store at {self.endpoint}: {op} {_short(key)} failed ({code}): {text}"
        raise StoreTimeout(message) if code == "timeout" else StoreError(message, str(code))

    def _request(self, op: str, key, arg, limit_s: float) -> tuple[bool, object]:
        request_id = next(self._ids)
        deadline = time.monotonic() + limit_s
        self._send(encode_request(request_id, op, key, arg), deadline, op, limit_s)
        while True:
            got_id, ok, result = decode_reply(self._receive(deadline, op, limit_s))
            if got_id == request_id:  # anything else answers a request given up on earlier
                return ok, result

    def _send(self, payload: bytes, deadline: float, op: str, limit_s: float) -> None:
        while True:
            try:
                self.sock.send(payload, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._wait(zmq.POLLOUT, deadline, op, limit_s)

    def _receive(self, deadline: float, op: str, limit_s: float) -> bytes:
        self._wait(zmq.POLLIN, deadline, op, limit_s)
        return self.sock.recv()

    def _wait(self, event: int, deadline: float, op: str, limit_s: float) -> None:
        """Until the socket is ready for ``event``; a refused handshake or the deadline raises."""
        poller = zmq.Poller()
        poller.register(self.sock, event)
        poller.register(self.monitor.socket, zmq.POLLIN)
        while True:
            if self._closing:
                raise StoreError(f"the client of the rendezvous store at {self.endpoint} was closed while it "
                                 f"waited to {op}", "closed")
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise StoreError(f"no answer from the rendezvous store at {self.endpoint} to {op} within "
                                 f"{limit_s:g} s (is the broadcaster up, reachable from here, and does it "
                                 f"admit this process's key?)", "unanswered")
            ready = dict(poller.poll(min(left_ms, CLOSE_POLL_MS)))
            if self.monitor.socket in ready:
                self._refused()
            if self.sock in ready:
                return

    def _refused(self) -> None:
        for event in self.monitor.events():
            if event["event"] & curve.HANDSHAKE_FAILED:
                why = curve.refused_by_hub(event["event"], int(event["value"]), secure=self.secure)
                raise StoreError(f"the rendezvous store at {self.endpoint} refused this process: {why}", "refused")
