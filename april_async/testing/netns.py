"""Several hosts on one machine: Linux network namespaces on a private bridge.

``Hosts(n)`` makes ``n`` namespaces, each with one interface ``eth0`` at ``10.77.0.<i+1>/24``,
wired to a bridge that lives in a namespace of its own (the machine's own network is not touched),
and loopback up. Nothing routes out of ``10.77.0.0/24``: every address a test can reach through
them is one of its own hosts. Names carry this process's pid, so parallel tests do not collide;
``close`` kills whatever still runs in the namespaces (counting it) and deletes them.

Partitions: ``cut(i)`` takes host ``i``'s link down (its routes go with it, so its own sends
fail at once, as with a pulled cable), ``restore(i)`` brings it back; ``drop(i, "out"|"in"|"both")``
loses every packet leaving host ``i``, arriving at it, or both, silently and with the link up (a
``blackhole`` queueing discipline on its ``eth0``, or on its port of the bridge for what arrives:
``tc netem`` and ``iptables`` are often missing where the kernel's own ``blackhole`` is not),
``undrop(i)`` ends that.

Needs root and ``ip netns``: ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

SUBNET = "10.77.0"


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"april-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {r.stderr.strip()}")


class Hosts:
    """``n`` namespaces ``names[i]`` at ``addresses[i]`` on one bridge."""

    def __init__(self, n: int, tag: str = "h"):
        base = f"ap{os.getpid() % 100000}{tag}"
        self.switch = f"{base}-sw"
        self.names = [f"{base}{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.leftovers: dict[str, list[int]] = {}
        try:
            self._build()
        except Exception:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")

    def by_address(self) -> dict[str, str]:
        return dict(zip(self.addresses, self.names))

    def run(self, i: int, *argv: str, **kw) -> subprocess.CompletedProcess:
        """``argv`` in host ``i``'s namespace, to the end."""
        return subprocess.run(["ip", "netns", "exec", self.names[i], *argv], **kw)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: both ways, and its own sends fail at once (no route)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up (after ``cut``)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up")

    def drop(self, i: int, direction: str = "both") -> None:
        """Lose every packet leaving host ``i`` (``out``), arriving at it (``in``), or both, with
        its link up: nothing tells either side, as when a switch in between fails."""
        if direction not in ("out", "in", "both"):
            raise ValueError(f"direction {direction!r} is not out, in or both")
        if direction in ("out", "both"):
            _tc(self.names[i], "qdisc", "replace", "dev", "eth0", "root", "blackhole")
        if direction in ("in", "both"):
            _tc(self.switch, "qdisc", "replace", "dev", f"port{i}", "root", "blackhole")

    def undrop(self, i: int) -> None:
        """End ``drop`` on host ``i``, both ways (a direction not dropped is left as it is)."""
        for ns, dev in ((self.names[i], "eth0"), (self.switch, f"port{i}")):
            shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True).stdout
            if "blackhole" in shown:
                _tc(ns, "qdisc", "del", "dev", dev, "root")

    def pids(self, i: int) -> list[int]:
        """Processes running in host ``i``'s namespace."""
        r = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def existing(self) -> list[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        present = {line.split()[0] for line in listed.splitlines() if line.strip()}
        return [ns for ns in [*self.names, self.switch] if ns in present]

    def close(self) -> None:
        """Kill what still runs in the namespaces (noted in ``leftovers``), then delete them."""
        for i, ns in enumerate(self.names):
            if ns not in self.existing():
                continue
            pids = self.pids(i)
            if pids:
                self.leftovers[ns] = pids
            for _ in range(3):
                for pid in self.pids(i):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if not self.pids(i):
                    break
                time.sleep(0.2)
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
