"""The learner → broadcaster hand-off through shared memory (protocol 1.7), end to end: a real
broadcaster process, a real member process (``april_async.testing.weights``'s ``WeightSubscriber``,
which checks every bucket against the announced digests before it loads), and the learner's own
``WeightHandoff`` in this process (or in a child process that is killed). Also the fall-back to a
ZeroMQ message when the broadcaster offers no shared memory or cannot open a region, and that no
``/dev/shm`` name is left behind after a clean close, or after a SIGKILL of the learner once a
learner of the same name has started again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from april_async.testing.cluster import FAST_LINK
from april_async.testing.procs import ROOT, free_port
from april_async.testing.weights import LINK, TIMEOUT_S, Weights, state_fingerprint, policy
from april_async.transport.peer import Peer
from april_async.weights import shm
from april_async.weights.flat import buckets, flatten, tensor_buckets
from april_async.weights.handoff import WeightHandoff

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm on this host")


def names(instance: str, *, any_process: bool = False) -> set[str]:
    """The ``/dev/shm`` names of ``instance``'s regions made by this process (the in-process learners
    of these tests), or by any process: a run on the other test worker has a ``learner-0`` too."""
    prefix = f"{shm.PREFIX}{shm._safe(instance)}-" + ("" if any_process else f"{os.getpid()}-")
    return {p.name for p in shm.SHM_DIR.iterdir() if p.name.startswith(prefix)}


def start_broadcaster(w: Weights, **extra) -> None:
    w.cluster.start("broadcaster", "broadcaster", {
        "name": "broadcaster", "bind": w.endpoint, "link.broker": w.broker.hub.endpoint, **FAST_LINK,
        "store_port": free_port(), "backend": "gloo", "bucket_mb": 0.25, "timeout_s": TIMEOUT_S,
        "status_file": str(w.status_file), **extra})


class Learner:
    """``WeightHandoff`` over a real ``Peer``, handing over ``policy(version)``."""

    def __init__(self, w: Weights, name: str = "learner-0", mode: str = "auto"):
        self.version = 0
        self.handoff = WeightHandoff(name, lambda oc: Peer(w.endpoint, name, link=LINK, on_connect=oc),
                                     lambda: (self.version, policy(self.version)), mode=mode)

    def send(self, version: int) -> str:
        self.version = version
        self.handoff.send(version, policy(version))
        return state_fingerprint(policy(version))


def wait(w: Weights, what: str, cond, handoff: WeightHandoff | None = None, timeout_s: float = 25.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; status {w.status()}\n{w.cluster.dump_logs()}")
        w.broker.pump(0.05)
        if handoff is not None:
            handoff.pump()
        w.cluster.assert_alive()


def log_of(w: Weights, name: str) -> str:
    return w.cluster.logs[name].read_text(errors="replace")


def test_versions_go_through_shared_memory_and_members_load_them_verified(weights):
    w = weights
    start_broadcaster(w)
    w.start_member("gen-0")
    learner = Learner(w)
    h = learner.handoff
    try:
        wait(w, "the welcome offering shared memory", lambda: h.shm_host is not None, h)
        assert h.shm_host == shm.host_id()
        expect = learner.send(1)
        wait(w, "gen-0 holding version 1", lambda: w.holds("gen-0", 1, expect), h)
        assert h.last_mode == "shm"

        # version 2 in parts, produced in place in the region (as the sharded learner does)
        specs, buf = flatten(policy(2))
        data = buf.numpy()
        cuts = tensor_buckets(specs, 1 << 18)
        assert len(cuts) > 1

        def parts():
            for start, stop, _ in cuts:
                target = h.part_target(start, stop)
                assert target is not None
                target[:] = data[start:stop]
                yield start, target

        learner.version = 2
        h.send_parts(2, specs, len(data), parts(), len(cuts))
        wait(w, "gen-0 holding version 2", lambda: w.holds("gen-0", 2, state_fingerprint(policy(2))), h)
        # back into version 1's region once the broadcaster let go of it (its next heartbeat says
        # so; sent before that, the version would go as bytes: the learner never waits)
        wait(w, "the broadcaster letting go of version 1's region", lambda: h.free_regions == 1, h)
        expect = learner.send(3)
        wait(w, "gen-0 holding version 3", lambda: w.holds("gen-0", 3, expect), h)
        assert h.shm_sends == 3 and h.shm_fallbacks == 0 and h.shm_off is None
        wait(w, "the regions' names unlinked once mapped", lambda: not names("learner-0"), h)
        member = log_of(w, "gen-0")
        assert "weights_unverified" not in member and "weights_refused" not in member
        assert "region_unavailable" not in log_of(w, "broadcaster")
    finally:
        h.close()
    assert not names("learner-0")


def test_a_broadcaster_without_shared_memory_gets_the_bytes(weights):
    w = weights
    start_broadcaster(w, handoff="zmq")
    w.start_member("gen-0")
    learner = Learner(w)
    h = learner.handoff
    try:
        wait(w, "the welcome", lambda: h.peer_proto is not None, h)
        assert h.shm_host is None
        expect = learner.send(1)
        wait(w, "gen-0 holding version 1", lambda: w.holds("gen-0", 1, expect), h)
        assert h.shm_sends == 0 and h.last_mode == "zmq" and not names("learner-0")
    finally:
        h.close()


def test_a_region_the_broadcaster_cannot_open_falls_back_to_bytes(weights, monkeypatch):
    w = weights
    start_broadcaster(w)
    w.start_member("gen-0")
    export = shm.ShmRegion.export

    def vanishing(self, version):  # the name is gone before the broadcaster can open it
        handle = export(self, version)
        self.unlink()
        return handle

    monkeypatch.setattr(shm.ShmRegion, "export", vanishing)
    learner = Learner(w)
    h = learner.handoff
    try:
        wait(w, "the welcome offering shared memory", lambda: h.shm_host is not None, h)
        expect = learner.send(1)
        assert h.last_mode == "shm"
        wait(w, "gen-0 holding version 1, sent again as bytes", lambda: w.holds("gen-0", 1, expect), h)
        assert h.shm_off is not None and "cannot open" in h.shm_off and h.last_mode == "zmq"
        assert "region_unavailable" in log_of(w, "broadcaster")
        expect = learner.send(2)  # shared memory stays off for this session
        wait(w, "gen-0 holding version 2", lambda: w.holds("gen-0", 2, expect), h)
        assert h.last_mode == "zmq"
    finally:
        h.close()
    assert not names("learner-0")


CHILD = """
import sys, time
from april_async.testing.weights import LINK, policy
from april_async.transport.peer import Peer
from april_async.weights import shm
from april_async.weights.handoff import WeightHandoff

endpoint = sys.argv[1]
h = WeightHandoff("learner-k9", lambda oc: Peer(endpoint, "learner-k9", link=LINK, on_connect=oc),
                  lambda: (1, policy(1)))
while h.shm_host is None:
    h.pump()
    time.sleep(0.01)
h.send(1, policy(1))
spare = shm.ShmRegion.create("learner-k9", 1 << 16)  # a region nobody mapped: only a restart can take it
print("sent", h.last_mode, spare.name, flush=True)
while True:
    h.pump()
    time.sleep(0.01)
"""


def test_no_region_is_left_after_kill_9_of_the_learner_and_a_restart(weights):
    w = weights
    start_broadcaster(w)
    w.start_member("gen-0")
    child = subprocess.Popen([sys.executable, "-c", CHILD, w.endpoint], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    h = None
    try:
        # Its log lines share stdout (a hub_silent warning came first once, on a loaded machine).
        line = next((ln.split() for ln in child.stdout if ln.startswith("sent ")), [])
        assert line[:2] == ["sent", "shm"], line
        wait(w, "gen-0 holding version 1", lambda: w.holds("gen-0", 1, state_fingerprint(policy(1))))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert line[2] in names("learner-k9", any_process=True), "the unmapped region outlives a SIGKILL until a restart"

        learner = Learner(w, "learner-k9")  # the restart: takes the dead process's names
        h = learner.handoff
        assert not names("learner-k9", any_process=True)
        wait(w, "the welcome offering shared memory", lambda: h.shm_host is not None, h)
        expect = learner.send(2)
        wait(w, "gen-0 holding version 2", lambda: w.holds("gen-0", 2, expect), h)
        assert h.last_mode == "shm"
    finally:
        if child.poll() is None:
            child.kill()
        if h is not None:
            h.close()
    assert not names("learner-k9", any_process=True)


def test_parts_sent_as_bytes_are_hashed_as_they_arrive_and_load_verified(weights):
    """The ZeroMQ path in parts: the broadcaster hashes each 256 KiB bucket once its bytes are in,
    while later parts still arrive; members check those digests and load."""
    w = weights
    start_broadcaster(w)
    w.start_member("gen-0")
    learner = Learner(w, mode="zmq")
    h = learner.handoff
    try:
        wait(w, "the welcome", lambda: h.peer_proto is not None, h)
        for version in (1, 2):
            specs, buf = flatten(policy(version))
            data = buf.numpy()
            cuts = list(buckets(len(data), 100_000))  # parts that straddle the digest buckets
            learner.version = version
            h.send_parts(version, specs, len(data), ((start, data[start:stop].copy()) for start, stop in cuts),
                         len(cuts))
            wait(w, f"gen-0 holding version {version}", lambda v=version: w.holds("gen-0", v, state_fingerprint(policy(v))), h)
        assert h.last_mode == "zmq" and h.shm_sends == 0
        assert "weights_refused" not in log_of(w, "gen-0")
    finally:
        h.close()
