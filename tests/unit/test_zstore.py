"""The rendezvous store (``weights.zstore``): a service and its clients in one process, over real
ZeroMQ sockets on loopback (CurveZMQ with real keys where a test says so), and a 2-rank gloo
group formed over it."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import msgpack
import pytest
import torch
import torch.distributed as dist
import zmq

from april_async.transport.curve import KeysError, make_host_keys, make_keys
from april_async.weights import zstore
from april_async.weights.zstore import StoreError, StoreService, StoreTimeout, ZmqStore

SHORT_S = 0.3  # a wait meant to time out


@pytest.fixture
def service():
    svc = StoreService("tcp://127.0.0.1:0")
    yield svc
    svc.close()


@pytest.fixture
def client(service):
    store = ZmqStore(service.endpoint, timeout_s=5.0)
    yield store
    store.close()


def raw(endpoint: str) -> zmq.Socket:
    """A bare DEALER on the service: sends whatever a test wants."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, *frames: bytes) -> list:
    sock.send_multipart(list(frames))
    assert sock.poll(5000), "the service did not answer"
    return msgpack.unpackb(sock.recv(), raw=False)


def test_every_operation(client):
    client.set("a", b"1")
    client.set("s", "text")  # torch's Python callers pass str, and lists of ints
    client.set("l", [104, 105])
    assert client.get("a") == b"1" and client.get("s") == b"text" and client.get("l") == b"hi"
    assert client.add("n", 3) == 3 and client.add("n", -1) == 2 and client.get("n") == b"2"
    assert client.compare_set("c", b"x", b"y") == b"x", "a missing key stays missing unless expected is empty"
    assert not client.check(["c"])
    assert client.compare_set("c", b"", b"v1") == b"v1"
    assert client.compare_set("c", b"other", b"v2") == b"v1"
    assert client.compare_set("c", "v1", "v2") == b"v2"
    client.append("log", b"ab")
    client.append("log", b"cd")
    assert client.get("log") == b"abcd"
    assert client.check(["a", "n"]) and not client.check(["a", "nope"])
    client.wait(["a", "n"])
    client.wait(["a"], datetime.timedelta(seconds=1))
    assert client.num_keys() == 6
    assert client.delete_key("a") and not client.delete_key("a")
    assert client.num_keys() == 5
    assert client.multi_get(["s", "l"]) == [b"text", b"hi"]
    client.multi_set(["m1", "m2"], [b"1", b"2"])
    assert client.get("m2") == b"2"


def test_there_is_no_way_to_list_keys(client, service):
    client.set("secret/epoch-1/0/0", b"addr")
    with pytest.raises(StoreError, match="lists no keys"):
        client.list_keys()
    sock = raw(service.endpoint)
    try:
        reply = ask(sock, msgpack.packb([7, "list_keys", None, None]))
        assert reply[:2] == [7, False] and reply[2][0] == "unknown_op"
    finally:
        sock.close()


def test_a_get_or_wait_wakes_when_its_key_arrives(service, client):
    other = ZmqStore(service.endpoint, timeout_s=5.0)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", client.get("late")))
    t.start()
    try:
        time.sleep(0.2)
        assert "v" not in got
        other.set("late", b"here")  # from another client, while the first one's get is parked
        t.join(5)
        assert got["v"] == b"here"
    finally:
        other.close()


def test_waits_that_time_out_say_so_and_name_the_endpoint(service):
    store = ZmqStore(service.endpoint, timeout_s=SHORT_S)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match=rf"{service.endpoint}.*get 'nope'.*timeout"):
            store.get("nope")
        assert SHORT_S <= time.monotonic() - t0 < SHORT_S + zstore.REPLY_GRACE_S
        with pytest.raises(StoreTimeout, match=r"wait.*1 of 2 keys"):
            store.set("here", b"1")
            store.wait(["here", "absent"], datetime.timedelta(seconds=SHORT_S))
        assert store.get("here") == b"1", "the client still works after a timeout"
        assert not service.waiters, "timed-out waiters are let go"
    finally:
        store.close()


def test_a_service_that_does_not_answer_is_an_error_not_a_hang():
    # A port that accepts connections and never speaks (a service closed instead would free its
    # port, which a test running beside this one may take and answer on).
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    endpoint = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
    store = ZmqStore(endpoint, timeout_s=SHORT_S)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=rf"no answer from the rendezvous store at {endpoint}"):
            store.set("a", b"1")
        with pytest.raises(StoreError, match="no answer"):
            store.get("a")
        assert time.monotonic() - t0 < 2 * SHORT_S + zstore.REPLY_GRACE_S + 1
    finally:
        store.close()
        mute.close()


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1"], "malformed"),  # not MessagePack
    ([msgpack.packb({"op": "get"})], "malformed"),
    ([msgpack.packb([1, "get"])], "malformed"),
    ([msgpack.packb(["id", "get", "k", 100])], "malformed"),
    ([msgpack.packb([1, "set", "k", None]), b"extra"], "malformed"),  # one frame per request
    ([msgpack.packb([2, "explode", "k", None])], "unknown_op"),
    ([msgpack.packb([3, "set", 5, b"v"])], "bad_type"),
    ([msgpack.packb([4, "set", "k", "not bin"])], "bad_type"),
    ([msgpack.packb([5, "get", "k", -1])], "bad_type"),
    ([msgpack.packb([6, "wait", "not a list", 100])], "bad_type"),
    ([msgpack.packb([7, "compare_set", "k", [b"only one"]])], "bad_type"),
    ([msgpack.packb([8, "add", "k", "1"])], "bad_type"),
    ([msgpack.packb([9, "set", "k", b"x" * (zstore.MAX_VALUE_BYTES + 1)])], "too_large"),
])
def test_a_bad_request_is_answered_with_an_error_and_the_service_goes_on(service, client, frames, code):
    sock = raw(service.endpoint)
    try:
        reply = ask(sock, *frames)
        assert reply[1] is False and reply[2][0] == code, reply
        client.set("after", b"ok")  # still serving
        assert client.get("after") == b"ok"
        assert service._thread.is_alive()
    finally:
        sock.close()


def test_add_to_a_value_that_is_not_a_number(client):
    client.set("k", b"abc")
    with pytest.raises(StoreError, match=r"bad_value.*'k' holds b'abc'"):
        client.add("k", 1)


def test_a_frame_over_the_limit_is_dropped_and_the_service_goes_on(service, client):
    sock = raw(service.endpoint)
    try:
        sock.send(b"x" * (zstore.MAX_FRAME_BYTES + 1))
        time.sleep(0.2)
        assert service._thread.is_alive()
        client.set("k", b"v")
        assert client.get("k") == b"v"
    finally:
        sock.close()


def test_forget_deletes_one_epochs_keys(service, client):
    for key in ("p/epoch-1/0/0", "p/epoch-1/0/1", "p/epoch-2/0/0", "p/epoch-10/0/0"):
        client.set(key, b"x")
    assert service.forget("p/epoch-1/") == 2
    assert client.check(["p/epoch-2/0/0", "p/epoch-10/0/0"]) and not client.check(["p/epoch-1/0/0"])


def test_cancel_lets_one_epochs_waiters_go_at_once_and_refuses_later_waits(service, client):
    """Rank 0 gives up forming an epoch whose member went dark: the members already waiting at its
    rendezvous must not be held for their whole timeout (issue 29), nor may a late one wait there."""
    got = {}

    def waiting():
        try:
            client.get("p/epoch-3/0/2")
        except StoreError as e:
            got["error"] = str(e)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    service.cancel("p/epoch-3/")
    t.join(5)
    assert "cancelled" in got.get("error", "") and time.monotonic() - t0 < 1.0, got
    other = ZmqStore(service.endpoint, timeout_s=5.0)
    try:
        with pytest.raises(StoreError, match="cancelled"):
            other.wait(["p/epoch-3/0/1"])
        other.set("p/epoch-4/0/1", b"x")  # the next epoch meets as before
        assert other.get("p/epoch-4/0/1") == b"x"
    finally:
        other.close()


# ---------------------------------------------------------------------------------------------
# Keys


@pytest.fixture
def keyed(tmp_path):
    keys = tmp_path / "run"
    make_keys(keys)
    svc = StoreService("tcp://127.0.0.1:0", keys=keys)
    yield keys, svc
    svc.close()


def test_an_admitted_client_is_served(keyed):
    keys, svc = keyed
    assert svc.secure
    store = ZmqStore(svc.endpoint, keys=keys, timeout_s=5.0)
    try:
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.close()


def test_a_keyless_client_is_refused_when_the_service_has_keys(keyed):
    _, svc = keyed
    store = ZmqStore(svc.endpoint, timeout_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=rf"{svc.endpoint} refused this process.*no CURVE"):
            store.set("k", b"v")
        assert time.monotonic() - t0 < 5.0, "refused at the handshake, not after the timeout"
    finally:
        store.close()


def test_a_client_whose_key_is_not_admitted_is_refused(tmp_path):
    make_host_keys(tmp_path / "k", ["head", "stranger"])
    head = tmp_path / "k" / "head"
    (head / "authorized" / "stranger.key").unlink()
    svc = StoreService("tcp://127.0.0.1:0", keys=head)
    store = ZmqStore(svc.endpoint, keys=tmp_path / "k" / "stranger", timeout_s=5.0)
    try:
        with pytest.raises(StoreError, match="refused this process.*not in the hub's authorized"):
            store.set("k", b"v")
    finally:
        store.close()
        svc.close()


def test_without_keys_it_binds_loopback_only_unless_the_network_is_trusted():
    with pytest.raises(KeysError, match="reachable from other hosts"):
        StoreService("tcp://0.0.0.0:0")
    svc = StoreService("tcp://0.0.0.0:0", allow_open=True)
    svc.close()


# ---------------------------------------------------------------------------------------------
# torch.distributed over it


def test_a_gloo_group_forms_over_the_store_and_broadcasts(keyed):
    keys, svc = keyed
    results, errors = {}, []

    def rank(r: int) -> None:
        store = ZmqStore(svc.endpoint, keys=keys, timeout_s=10.0)
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=10)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(dist.PrefixStore("secret/epoch-1", store), r, 2, opts)
            t = torch.arange(6, dtype=torch.float32) if r == 0 else torch.zeros(6)
            pg.broadcast(t, 0).wait()
            results[r] = t.tolist()
            del pg
        except Exception as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert results == {0: [0, 1, 2, 3, 4, 5], 1: [0, 1, 2, 3, 4, 5]}
    assert svc.forget("secret/epoch-1/") >= 2, "the group's keys were in the rendezvous store"
