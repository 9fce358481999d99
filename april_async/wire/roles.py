"""Who may send what: the sender column of SPEC's message table (``proto/SPEC.md``, *Messages*),
and which instance of a role may move the policy version (``VersionRight``, SPEC *Messages* rule 2).

A hub refuses, with ``error`` ``refused``, a message whose type the role its sender said ``hello``
as may not send, and acts on nothing in it (SPEC, *Messages*, rule 1); ``tests/unit/test_roles.py``
checks this table against SPEC's. Which types a hub *takes* is its own business: a type its
sender's role may send but that travels on another hub (a ``weights_update`` sent to the broker)
is refused by the receiving service as it was before this table existed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

from april_async.wire.messages import MESSAGE_TYPES, Role

ROLES: tuple[str, ...] = get_args(Role)
"""Every role a ``hello`` may name: ``broker`` and the actors."""
ACTORS: tuple[str, ...] = tuple(r for r in ROLES if r != "broker")
"""SPEC's "any actor": every role but the hub's."""

SENDERS: dict[str, frozenset[str]] = {
    "hello": frozenset(ACTORS),
    "welcome": frozenset({"broker"}),
    "heartbeat": frozenset(ROLES),
    "bye": frozenset(ACTORS),
    "error": frozenset(ROLES),
    "generate": frozenset({"broker"}),
    "token_chunk": frozenset({"generator"}),
    "finished": frozenset({"generator"}),
    "progress": frozenset({"generator"}),
    "abort": frozenset({"broker"}),
    "score_request": frozenset({"broker"}),
    "scored": frozenset({"scorer"}),
    "batch_request": frozenset({"learner"}),
    "batch": frozenset({"broker"}),
    "batch_report": frozenset({"learner"}),
    "weights_update": frozenset({"learner"}),
    "weights_announce": frozenset({"broadcaster"}),
    # broadcaster → broker → generators (the broker forwards it), or learner → broker
    "weights_published": frozenset({"broadcaster", "broker", "learner"}),
}
"""msg_type → the roles that may send it."""

assert SENDERS.keys() == MESSAGE_TYPES.keys(), "every message type needs its senders"


def may_send(role: str, msg_type: str) -> bool:
    return role in SENDERS.get(msg_type, ())


def refusal(role: str, msg_type: str) -> str | None:
    """The ``error`` message that refuses a ``msg_type`` from a session of ``role``, or None when
    that role may send it."""
    if may_send(role, msg_type):
        return None
    senders = ", ".join(r for r in ROLES if r in SENDERS.get(msg_type, ())) or "nobody"
    return f"a {role} may not send {msg_type} (sent by {senders}; proto/SPEC.md, Messages)"


class VersionRight:
    """Which instance of each role moves the policy version now (SPEC, *Messages*, rule 2): the first
    to try holds the right while any session of that instance lives, and it passes on once none is
    left. An instance, not a sender: a restarted process keeps its instance and takes a new sender
    name, so it holds the right again at once, beside its old session if that has not expired yet.
    Pure: the hub's service says which sessions live."""

    def __init__(self):
        self.holders: dict[str, str] = {}  # role -> instance

    def claim(self, role: str, instance: str, sessions: Iterable[tuple[str, str, str]]) -> str | None:
        """``instance`` of ``role`` moves the version: None when it holds the right (now), else
        why not. ``sessions``: the live sessions, as ``(sender, role, instance)``."""
        holder = self.holders.get(role)
        if holder is not None and holder != instance:
            live = [name for name, r, i in sessions if r == role and i == holder]
            if live:
                return (f"the {role} {holder!r} (session {live[0]!r}) moves the policy version while its session "
                        f"lives: a second {role}, {instance!r}, may not")
        self.holders[role] = instance
        return None
