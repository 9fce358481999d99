"""The TCP connections of this process, by socket inode: to find the ones a group's join opened,
and to cut them when a member went dark mid-collective.

A collective blocked on a member that a network cut took away waits for the group's whole
``timeout_s`` (gloo's ``abort()`` and ``shutdown()`` interrupt nothing on torch 2.13, see
``weights.group``), and every other member waits with it: in issue 29 a 25 s cut held the round
(and the learner) for the whole cut. ``shutdown(2)`` on the group's own sockets makes the pending
operations fail at once, on this rank and, once the connections close, on the members'.

Linux only (``/proc/self/fd``, ``/proc/self/net/tcp*``); elsewhere nothing is found and nothing is cut.
"""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

_PROC_NET = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


ESTABLISHED, LISTEN = "01", "0A"  # the state column of /proc/net/tcp


def socket_inodes() -> set[int]:
    """The inodes of this process's sockets (its descriptors that read ``socket:[N]``); none where
    ``/proc/self/fd`` cannot be read."""
    mine = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                mine.add(int(target[8:-1]))
    except OSError:
        return set()
    return mine


class TcpRow(NamedTuple):
    """One of this process's sockets as the kernel's table lists it."""

    inode: int
    state: str  # ESTABLISHED, LISTEN, ...
    local: str  # the local address as the table writes it: hex, 8 digits for IPv4 (little-endian), 32 for IPv6
    local_port: int
    remote_port: int


def tcp_table() -> list[TcpRow]:
    """This process's TCP sockets, IPv4 and IPv6, from ``/proc/self/net/tcp*`` matched to its own
    socket inodes; empty where those cannot be read."""
    mine = socket_inodes()
    if not mine:
        return []
    rows = []
    for path in _PROC_NET:
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            inode = int(f[9])
            if inode in mine:
                local, local_port = f[1].rsplit(":", 1)
                rows.append(TcpRow(inode, f[3], local, int(local_port, 16), int(f[2].rsplit(":", 1)[1], 16)))
    return rows


def tcp_sockets() -> dict[int, tuple[int, int]]:
    """This process's connected TCP sockets: inode -> (local port, remote port). Listening ones
    are left out: gloo keeps a listener per group, and a listener shut down under it makes gloo's
    ``accept`` fail an ``enforce``, which ends the whole process (``std::terminate``)."""
    return {r.inode: (r.local_port, r.remote_port) for r in tcp_table() if r.state == ESTABLISHED}


def sever(inodes: set[int]) -> int:
    """``shutdown(SHUT_RDWR)`` every socket of this process among ``inodes`` (its owner's pending
    reads and writes fail; the descriptor stays its owner's to close); how many were cut."""
    cut = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith("socket:[") or int(target[8:-1]) not in inodes:
                continue
            dup = os.dup(int(fd))
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino in inodes:  # still that socket (the number may have been reused)
                s = socket.socket(fileno=dup)
                dup = None
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    cut += 1
                except OSError:
                    pass
                finally:
                    s.close()
        finally:
            if dup is not None:
                os.close(dup)
    return cut
