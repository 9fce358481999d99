"""Which of this host's addresses the weights group should use: the one that routes to the head.

A gloo or NCCL rank advertises an address that the other ranks connect to. Left to itself, gloo
takes the address the host name resolves to, which on many machines (and in every network
namespace of the tests) is 127.0.0.1: the other hosts then connect to themselves and the group
never forms. The right address is the local end of a route to the store's host, which the
kernel tells without sending a packet (``connect`` on a UDP socket only picks the route).

- ``route_address(host)``: that local address (``host`` itself when it is one of ours).
- ``interface_of(address)``: the interface holding an IPv4 address, for ``NCCL_SOCKET_IFNAME``.
- ``gloo_device(address)``: a gloo device on that address; ``GLOO_SOCKET_IFNAME``, when the user
  set it, still wins (an explicit choice is never second-guessed).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's IPv4 address


class RouteError(OSError):
    """No route from this host to the store's host, or a configured address that is not ours."""


def route_address(host: str) -> str:
    """The address of this host's interface that traffic to ``host`` leaves from."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise RouteError(f"cannot resolve the weights store's host {host!r}: {e}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)  # UDP: picks the route and the source address, sends nothing
        except OSError as e:
            raise RouteError(f"no route from this host to the weights store's host {host!r}: {e}") from None
        return s.getsockname()[0]


def check_local(address: str) -> str:
    """``address`` if a socket can bind it here (it is one of this host's), else a ``RouteError``."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        raise RouteError(f"weights address {address!r} is not an IP address") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((address, 0))
        except OSError as e:
            raise RouteError(f"weights address {address!r} is not an address of this host: {e}") from None
    return address


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address`` (None: not found, or IPv6)."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if ipaddress.IPv4Address(raw[20:24]) == wanted:
                return name
    return None


def gloo_device(address: str | None):
    """A gloo transport device bound to ``address`` (``GLOO_SOCKET_IFNAME``, when set, wins; None:
    gloo's default, the host name's address)."""
    import torch.distributed as dist

    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    if address is None:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=address)


def set_nccl_interface(address: str) -> str | None:
    """Point NCCL's sockets (bootstrap and, without InfiniBand, data) at ``address``'s interface,
    unless the user chose one (``NCCL_SOCKET_IFNAME``). Returns the interface in use."""
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        return os.environ["NCCL_SOCKET_IFNAME"]
    name = interface_of(address)
    if name is not None:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"  # '=': exactly this interface, not a prefix
    return name
