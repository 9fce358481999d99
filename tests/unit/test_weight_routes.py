"""The weights group's addresses and bounds: the route to the store's host, a store listening on one
address, a join that gives up at its timeout whatever gloo does."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch.distributed as dist

from april_async.weights.group import GroupError, WeightGroup, _bounded
from april_async.weights.routes import RouteError, check_local, interface_of, route_address
from april_async.weights.sockets import LISTEN, tcp_table
from april_async.wire.messages import GroupSpec


def test_the_route_to_a_local_address_leaves_from_it():
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("127.0.0.3").startswith("127.")  # loopback traffic leaves from loopback
    assert interface_of("127.0.0.1") == "lo"


def test_an_address_that_is_not_this_hosts_is_refused_with_its_name():
    with pytest.raises(RouteError, match="192.0.2.7"):
        check_local("192.0.2.7")  # TEST-NET-1: never assigned; nothing is sent to it
    with pytest.raises(RouteError, match="not an IP address"):
        check_local("head-node")
    with pytest.raises(RouteError, match="no-such-host.invalid"):
        route_address("no-such-host.invalid")


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses this process listens on at ``port``, from the kernel's own table
    (``sockets.tcp_table``). Probing another address with ``connect`` cannot tell: another process
    may listen there on the same number, and a connect to an ephemeral port nobody holds can meet
    itself (TCP simultaneous open)."""
    return {socket.inet_ntoa(bytes.fromhex(r.local)[::-1]) for r in tcp_table()
            if r.state == LISTEN and r.local_port == port and len(r.local) == 8}


def test_the_store_listens_on_its_address_alone():
    group = WeightGroup.host("127.0.0.2", 0, 5.0)
    port = group.store.port
    try:
        client = dist.TCPStore("127.0.0.2", port, None, False, timeout=datetime.timedelta(seconds=5))
        client.set("k", "v")
        assert group.store.get("k") == b"v"
        assert _listening_addresses(port) == {"127.0.0.2"}  # not 0.0.0.0, not 127.0.0.1
    finally:
        group.close()


@pytest.mark.parametrize("which", ["store", "rendezvous"])
def test_a_busy_port_is_a_group_error_naming_it(which):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        if which == "store":
            with pytest.raises(GroupError, match=f"TCPStore on 127.0.0.1:{port}"):
                WeightGroup.host("127.0.0.1", port, 5.0)
        else:
            with pytest.raises(GroupError, match=f"rendezvous store on 127.0.0.1:{port}"):
                WeightGroup.host("127.0.0.1", 0, 5.0, rendezvous_port=port)


def test_rank_0_advertises_the_store_address_and_a_member_its_route_to_it():
    group = WeightGroup.host("127.0.0.2", 0, 5.0)
    try:
        spec = GroupSpec(epoch=1, rank=0, world_size=2, store=f"127.0.0.2:{group.store.port}", backend="gloo")
        assert group.local_address(spec) == "127.0.0.2"
        member = WeightGroup()
        assert member.local_address(GroupSpec(epoch=1, rank=1, world_size=2, store=spec.store,
                                              backend="gloo")).startswith("127.")
        assert WeightGroup(address="127.0.0.5").local_address(spec) == "127.0.0.5"
    finally:
        group.close()


def test_a_bounded_call_returns_raises_or_is_abandoned_at_its_limit():
    assert _bounded(lambda: 7, 1.0, "x") == 7
    with pytest.raises(ZeroDivisionError):
        _bounded(lambda: 1 / 0, 1.0, "x")
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="forming epoch 3 did not finish within 0.3 s"):
        _bounded(lambda: time.sleep(3), 0.3, "forming epoch 3")
    assert time.monotonic() - t0 < 1.5


def test_a_join_whose_rank_0_never_comes_fails_within_its_timeout():
    host = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    member = WeightGroup()
    spec = GroupSpec(epoch=1, rank=1, world_size=2, store=f"127.0.0.1:{host.port}", backend="gloo", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="joining epoch 1 as rank 1 of 2 failed"):
        member.join(spec)
    assert time.monotonic() - t0 < spec.timeout_s + 3.0
    assert member.spec is None


def test_the_rendezvous_store_listens_on_the_store_host_alone_and_is_named_in_specs():
    group = WeightGroup.host("127.0.0.2", 0, 5.0, rendezvous_port=0)
    try:
        assert group.rendezvous.startswith("tcp://127.0.0.2:")
        port = int(group.rendezvous.rsplit(":", 1)[1])
        with socket.socket() as s:  # another address of this host: nobody listens there
            assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        group.close()
    assert WeightGroup.host("127.0.0.1", 0, 5.0).rendezvous is None, "no rendezvous_port: the TCPStore alone"


def test_an_open_rendezvous_store_beyond_loopback_needs_keys_or_a_trusted_network():
    with pytest.raises(GroupError, match="reachable from other hosts and no keys are set"):
        WeightGroup.host("0.0.0.0", 0, 5.0, rendezvous_port=0)
    group = WeightGroup.host("0.0.0.0", 0, 5.0, rendezvous_port=0, allow_open=True)
    group.close()


def test_a_join_over_the_rendezvous_store_whose_rank_0_never_comes_fails_within_its_timeout():
    root = WeightGroup.host("127.0.0.1", 0, 5.0, rendezvous_port=0)
    member = WeightGroup()
    spec = GroupSpec(epoch=1, rank=1, world_size=2, store=root.store_address, backend="gloo", timeout_s=2.0,
                     key_prefix="p" * 32, rendezvous=root.rendezvous)
    try:
        t0 = time.monotonic()
        with pytest.raises(GroupError, match="joining epoch 1 as rank 1 of 2 failed"):
            member.join(spec)
        assert time.monotonic() - t0 < spec.timeout_s + 3.0
        assert member.spec is None
    finally:
        member.close()
        root.close()


def test_rank_0_without_a_rendezvous_store_cannot_take_a_spec_that_names_one():
    group = WeightGroup.host("127.0.0.1", 0, 5.0)
    spec = GroupSpec(epoch=1, rank=0, world_size=1, store=group.store_address, backend="gloo",
                     rendezvous="tcp://127.0.0.1:1")
    try:
        with pytest.raises(GroupError, match="hosts none"):
            group.join(spec)
    finally:
        group.close()


def test_a_subscriber_joins_with_its_links_keys_and_its_configured_address(tmp_path):
    from april_async.config import LinkConfig
    from april_async.weights.subscriber import WeightSubscriber

    class Engine:
        policy_version = 0

        def load_weights(self, state, version):
            pass

    class Session:
        def __init__(self, on_connect):
            on_connect(self)

        def send(self, body, parent_id=None):
            pass

        def close(self):
            pass

    sub = WeightSubscriber("gen-0", "tcp://127.0.0.1:1", LinkConfig(keys=tmp_path), Engine(), peer_factory=Session,
                           address="127.0.0.1")
    try:
        assert sub.group.keys == tmp_path and sub.group.address == "127.0.0.1"
    finally:
        sub.close()
