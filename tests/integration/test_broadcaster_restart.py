"""A generator killed and started again under its own name (issue 42): the new process is a new
member of the weights group at once, whether the restart lands between rounds or during one, and
the member that stayed up is never dropped or benched for the other's death.

A real broadcaster and real member processes on loopback (``testing.weights``). The broadcaster's
peer timeout and collective timeout are long here (``LONG_S``), as on a cluster whose peers are
far apart: a restarted process says hello while its dead predecessor's session still lives, which
is the race that stopped a three-host run (the broadcaster kept the dead process's rank in the
group and waited on it, then benched both members). The new version must reach both members well
inside either timeout (``PROMPT_S``): nothing may wait for the dead process to time out.
"""

from __future__ import annotations

import re
import signal
import time

from april_async.testing.weights import policy, state_fingerprint

LONG_S = 20.0  # the broadcaster's peer timeout and its collective timeout in these tests
PROMPT_S = 8.0  # the new version on both members after the restart: well inside LONG_S
BROADCASTER = {"link.heartbeat_interval_s": 0.2, "link.peer_timeout_s": LONG_S,
               "timeout_s": LONG_S}


def hellos(w, name: str) -> int:
    log = w.cluster.logs["broadcaster"].read_text()
    return len(re.findall(rf"\bhello\b.*\bpeer={re.escape(name)}\b", log))


def started(w, v1: str) -> None:
    """The broadcaster, members gen-0 and gen-1, the learner; version 1 on both members."""
    w.start_broadcaster(**BROADCASTER)
    w.start_member("gen-0")
    w.start_member("gen-1")
    w.connect_learner()
    w.wait("both sessions", lambda: set(w.status().get("members", {})) == {"gen-0", "gen-1"})
    w.send_version(1)
    w.wait("version 1 on both", lambda: w.holds("gen-0", 1, v1) and w.holds("gen-1", 1, v1))


def restart(w, name: str):
    """kill -9 of member ``name``, and a new process under the same name at once; returns once the
    broadcaster heard the new one's hello (a torch import later), with the dead one's session alive."""
    before = hellos(w, name)
    w.cluster.kill(name)
    proc = w.start_member(name)
    w.wait(f"the new {name}'s hello", lambda: hellos(w, name) > before, timeout_s=30)
    return proc


def holds_from(w, name: str, version: int, expect: str, pid: int) -> bool:
    got = w.loads(name)
    last = got[-1] if got else {}
    return (last.get("version"), last.get("digest"), last.get("pid")) == (version, expect, pid)


def assert_healthy_member_kept(w, name: str = "gen-0") -> None:
    log = w.cluster.logs["broadcaster"].read_text()
    for event in ("peer_gone", "member_benched", "member_absent", "member_failing"):
        assert not re.search(rf"\b{event}\b.*\b(peer|member)={name}\b", log), \
            f"{name} stayed up but the broadcaster logged {event} for it:\n{log[-4000:]}"


def test_a_member_restarted_between_rounds_is_a_new_member_at_once(weights):
    w = weights
    v1, v2 = state_fingerprint(policy(1)), state_fingerprint(policy(2))
    started(w, v1)
    proc = restart(w, "gen-1")
    t0 = time.monotonic()
    w.send_version(2)
    w.wait("version 2 on gen-0 and on the new gen-1",
           lambda: w.holds("gen-0", 2, v2) and holds_from(w, "gen-1", 2, v2, proc.pid), timeout_s=LONG_S + 10)
    took = time.monotonic() - t0
    assert took < PROMPT_S, \
        f"version 2 took {took:.1f} s: the round waited on the dead process\n{w.cluster.dump_logs()}"
    assert [x["version"] for x in w.loads("gen-0")] == [1, 2]
    assert_healthy_member_kept(w)


def test_a_member_restarted_during_a_round_is_not_waited_for(weights):
    """gen-1 stops (SIGSTOP) with version 2 on its way: the round's collective waits on it. Then it
    is killed and started again. The round in flight must end without it, and the next one
    bring version 2 to both."""
    w = weights
    v1, v2 = state_fingerprint(policy(1)), state_fingerprint(policy(2))
    started(w, v1)
    w.cluster.procs["gen-1"].send_signal(signal.SIGSTOP)
    w.send_version(2)
    w.wait("the round of version 2 under way", lambda: (w.status().get("round") or {}).get("version") == 2,
           timeout_s=10)
    proc = restart(w, "gen-1")
    t0 = time.monotonic()
    w.wait("version 2 on gen-0 and on the new gen-1",
           lambda: w.holds("gen-0", 2, v2) and holds_from(w, "gen-1", 2, v2, proc.pid), timeout_s=LONG_S + 10)
    took = time.monotonic() - t0
    assert took < PROMPT_S, f"version 2 took {took:.1f} s after the restart\n{w.cluster.dump_logs()}"
    assert_healthy_member_kept(w)
