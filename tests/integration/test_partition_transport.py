"""The transport across a network cut: two hubs on one host, a process with a peer to each on
another (as a generator has its broker and broadcaster sessions on one thread), the second host's
link cut for longer than the peer's back-off takes to pass ``peer_timeout_s``, then restored.

Issue 29: the peers' back-off slept on the caller's thread, so once it was longer than
``peer_timeout_s`` each peer's sleep made the other's hub look silent, and neither session came
back. Each session must be back within one back-off cap plus one attempt of the link's return, and
stay up; the hubs must drop the connections the cut left half-open (ZeroMQ heartbeats), so that
each holds exactly one connection from the peer host afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from april_async.testing.linkcheck import LINK
from april_async.testing.netns import Hosts, unavailable
from april_async.testing.procs import ROOT
from april_async.transport.curve import make_keys
from april_async.transport.peer import RECONNECT_BACKOFF_MAX_S

WHY_NOT = unavailable()
PORTS = (5601, 5602)
CUT_S = 8.0  # the back-off passes peer_timeout_s (0.6 s) after about 4 s of silence
BACK_WITHIN_S = RECONNECT_BACKOFF_MAX_S * 1.2 + LINK["peer_timeout_s"] + 1.0


class Events:
    """A process's JSON lines, read on a thread as they come."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.rows, self.raw = proc, [], []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.raw.append(line)
            try:
                self.rows.append(json.loads(line))
            except ValueError:
                pass

    def after(self, t: float, event: str) -> list[dict]:
        return [r for r in self.rows if r["event"] == event and r["t"] >= t]


def spawn(hosts: Hosts, i: int, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", hosts.names[i], sys.executable, "-m",
                             "april_async.testing.linkcheck", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def connections(hosts: Hosts, port: int) -> int:
    out = hosts.run(0, "ss", "-tnH", "state", "established", f"( sport = :{port} )", capture_output=True,
                    text=True).stdout
    return len([ln for ln in out.splitlines() if ln.strip()])


@pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces: {WHY_NOT}")
@pytest.mark.parametrize("how", ["link", "drop"])
def test_two_sessions_on_one_thread_come_back_after_a_cut(tmp_path, how):
    make_keys(tmp_path / "keys")
    env = {**os.environ, "APRIL_KEYS": str(tmp_path / "keys"), "PYTHONPATH": str(ROOT)}
    with Hosts(2, tag="t") as hosts:
        head = hosts.addresses[0]
        hub = Events(spawn(hosts, 0, "hubs", head, *map(str, PORTS), env=env))
        peer = None
        try:
            deadline = time.monotonic() + 20
            while not hub.after(0, "serving") and time.monotonic() < deadline:
                time.sleep(0.05)
            peer = Events(spawn(hosts, 1, "peers", head, *map(str, PORTS), env=env))
            deadline = time.monotonic() + 20
            while {r["port"] for r in peer.after(0, "welcome")} != set(PORTS) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {r["port"] for r in peer.after(0, "welcome")} == set(PORTS), "".join(peer.raw + hub.raw)[-3000:]

            (hosts.cut if how == "link" else hosts.drop)(1)
            time.sleep(CUT_S)
            (hosts.restore if how == "link" else hosts.undrop)(1)
            back = time.time()
            gone = {r["port"] for r in hub.after(0, "gone")}
            assert gone == set(PORTS), f"the hubs never found the cut peer silent: {gone}"

            deadline = time.monotonic() + BACK_WITHIN_S
            while time.monotonic() < deadline:
                if {r["port"] for r in hub.after(back, "hello")} == set(PORTS):
                    break
                time.sleep(0.05)
            hellos = {r["port"]: r["t"] - back for r in hub.after(back, "hello")}
            assert set(hellos) == set(PORTS), f"sessions back: {hellos}\n" + "".join(peer.raw + hub.raw)[-4000:]
            print(f"sessions back {max(hellos.values()):.2f} s after the link returned ({how})")

            # And they stay up, for longer than a back-off: with the sleeping back-off, each session
            # came back for a moment, then went silent while the other peer slept.
            settled = back + max(hellos.values()) + 0.1
            time.sleep(RECONNECT_BACKOFF_MAX_S + 2.0)
            assert not hub.after(settled, "gone") and not peer.after(settled, "reconnect"), \
                "".join(peer.raw + hub.raw)[-4000:]
            assert [connections(hosts, p) for p in PORTS] == [1, 1], \
                hosts.run(0, "ss", "-tn", capture_output=True, text=True).stdout
        finally:
            for ev in (hub, peer):
                if ev is not None:
                    ev.proc.kill()
                    ev.proc.wait()
