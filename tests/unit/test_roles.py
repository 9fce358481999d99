"""The role table in code (``wire.roles.SENDERS``) says what SPEC's message table says."""

import re
from pathlib import Path

from april_async.wire import roles

SPEC = Path(__file__).resolve().parents[2] / "proto" / "SPEC.md"


def spec_senders() -> dict[str, frozenset[str]]:
    """msg_type → the roles in the sender column of SPEC's "## Messages" table. A route is
    ``a → b → c`` (everyone but the last sends), ``a ↔ b`` (both send), or several routes joined
    by ", or"; "any actor" is every role but the broker's, "any" every role."""
    section = SPEC.read_text().split("\n## Messages\n", 1)[1]
    table = section.split("| msg_type | sender → receiver | purpose |\n", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M)

    def names(part: str) -> set[str]:
        part = part.strip()
        if part == "any actor":
            return set(roles.ACTORS)
        if part == "any":
            return set(roles.ROLES)
        role = part.removesuffix("s") if part.removesuffix("s") in roles.ROLES else part
        assert role in roles.ROLES, f"{part!r} names no role"
        return {role}

    out = {}
    for msg_type, route_text in rows:
        senders: set[str] = set()
        for route in re.split(r",? or ", route_text):
            if "↔" in route:
                for side in route.split("↔"):
                    senders |= names(side)
            else:
                for hop in route.split("→")[:-1]:
                    senders |= names(hop)
        out[msg_type] = frozenset(senders)
    return out


def test_the_role_table_is_specs():
    assert roles.SENDERS == spec_senders()


def test_a_refusal_names_the_role_the_type_and_who_sends_it():
    assert roles.refusal("generator", "token_chunk") is None
    why = roles.refusal("generator", "weights_published")
    assert why.startswith("a generator may not send weights_published")
    assert "(sent by broker, learner, broadcaster;" in why
    assert roles.refusal("broker", "hello").startswith("a broker may not send hello")
    assert "sent by nobody" in roles.refusal("learner", "no_such_type")
