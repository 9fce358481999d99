"""Hubs and peers alone, as processes, for tests of the transport across a network cut.

    python -m april_async.testing.linkcheck hubs  ADDRESS PORT [PORT ...]   # one hub per port
    python -m april_async.testing.linkcheck peers ADDRESS PORT [PORT ...]   # one peer per hub, one thread

``hubs`` serves the way the broker and the broadcaster do: ``welcome`` to a ``hello``, ``refused``
to anyone else without a session, a heartbeat to every session each ``heartbeat_interval_s``,
sessions forgotten after ``peer_timeout_s`` of silence. ``peers`` runs every peer on one thread,
as a generator runs its broker and broadcaster sessions (waiting on all sockets, then reading each
without a wait). Both print one JSON object a line:
``{"t": wall time, "event": ..., "port": ...}`` (``hello``, ``gone`` on the hub side; ``welcome``,
``reconnect`` on the peer side). The timing is ``LINK``, fast enough for a test, and keys come from
``APRIL_KEYS`` as for any actor.
"""

from __future__ import annotations

import json
import sys
import time

from april_async.config import LinkConfig
from april_async.transport.hub import Hub
from april_async.transport.peer import Peer, wait_any
from april_async.wire import messages as m

LINK = dict(heartbeat_interval_s=0.1, peer_timeout_s=0.6, allow_open=True)


def say(event: str, **fields) -> None:
    print(json.dumps({"t": time.time(), "event": event, **fields}), flush=True)


def hubs(address: str, ports: list[int]) -> None:
    link = LinkConfig(**LINK)
    hubs = {p: Hub(f"tcp://{address}:{p}", link=link, name=f"hub-{p}") for p in ports}
    sessions: dict[int, dict[str, list]] = {p: {} for p in ports}
    say("serving", ports=ports)
    while True:
        for port, hub in hubs.items():
            for identity, msg in hub.poll(0.01):
                if isinstance(msg.body, m.Hello):
                    sessions[port][msg.sender] = [identity, 0.0]
                    hub.send(identity, m.Welcome(broker_epoch="e", policy_version=0,
                                                 heartbeat_interval_s=link.heartbeat_interval_s,
                                                 peer_timeout_s=link.peer_timeout_s,
                                                 max_message_bytes=link.max_message_bytes), parent_id=msg.msg_id)
                    say("hello", port=port, peer=msg.sender)
                elif msg.sender not in sessions[port]:
                    hub.send(identity, m.Error(code="refused", message="no session"), parent_id=msg.msg_id)
            now = time.monotonic()
            for name in hub.expired_peers(now):
                if sessions[port].pop(name, None) is not None:
                    say("gone", port=port, peer=name)
            for s in sessions[port].values():
                if now - s[1] >= link.heartbeat_interval_s:
                    hub.send(s[0], m.Heartbeat(policy_version=0))
                    s[1] = now


def peers(address: str, ports: list[int]) -> None:
    link = LinkConfig(**LINK)
    made: dict[int, Peer] = {}

    def on_connect(port):
        def hello(peer):
            peer.send(m.Hello(role="generator", instance="g"))
            if port in made:
                say("reconnect", port=port)
        return hello

    for p in ports:
        made[p] = Peer(f"tcp://{address}:{p}", "gen-0", link=link, on_connect=on_connect(p))
    while True:  # the generator's loop: wait on every socket at once, then read each without waiting
        wait_any([p.sock for p in made.values()], link.heartbeat_interval_s / 4)
        for port, peer in made.items():
            msg = peer.poll(0.0)
            while msg is not None:
                if msg.msg_type == "welcome":
                    say("welcome", port=port)
                msg = peer.poll(0.0)


if __name__ == "__main__":
    mode, addr, *rest = sys.argv[1:]
    {"hubs": hubs, "peers": peers}[mode](addr, [int(p) for p in rest])
