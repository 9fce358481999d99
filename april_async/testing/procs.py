"""Child processes for tests and tools: free ports, and children that die with their parent."""

from __future__ import annotations

import functools
import json
import os
import queue
import random
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from april_async.runtime import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (children run from it, so that ``tools/`` and ``python -m`` find the same files)."""


FREE_PORTS = range(20000, 32000)
"""Where ``free_port`` looks: below the kernel's ephemeral range (Linux: 32768-60999 by default).
A port the kernel handed out for ``bind(0)`` was freed for a child to bind later, and meanwhile
any process binding port 0 (a test's own listener, a ZeroMQ or gloo socket) could be given the
same port: a broadcaster test's store failed so in a fresh-clone CI run."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range, so
    that no ``bind(0)`` takes it before the caller's child binds it."""
    rng = random.Random()  # not the global generator, which tests seed
    for _ in range(200):
        port = rng.choice(FREE_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} after 200 tries")


def spawn(cmd: list[str], *, log: Path, stdout=None, own_group: bool = False,
          text: bool = False) -> subprocess.Popen:
    """Start ``cmd`` from the checkout, unbuffered, its output in ``log`` (its stdout elsewhere when
    ``stdout`` is given, e.g. ``subprocess.PIPE``). It gets SIGTERM when this process dies
    (``die_with_parent``), so a crashed test or tool leaves nothing running."""
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out if stdout is None else stdout, stderr=out, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=text,
                                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, own_group=own_group))


def stop(procs: dict[str, subprocess.Popen], timeout_s: float = 10.0) -> dict[str, int]:
    """SIGTERM every process still running, then SIGKILL what has not exited after ``timeout_s``;
    the exit codes by name."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = proc.wait()
    return codes


class ChildFailed(RuntimeError):
    """A child process of a ``Children`` group exited while it was expected to run."""


@dataclass
class Children:
    """A group of child processes, each with a log under ``logs``: started, watched, stopped together.
    A child started with ``reports=True`` writes one JSON object per line on its stdout; they arrive,
    as ``(name, object)``, in ``reports``."""

    logs: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    reports: queue.Queue = field(default_factory=queue.Queue)
    pids: list[int] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], *, reports: bool) -> subprocess.Popen:
        proc = spawn(cmd, log=self.logs / f"{name}.log", stdout=subprocess.PIPE if reports else None,
                     own_group=True, text=True)
        self.procs[name] = proc
        self.pids.append(proc.pid)
        if reports:
            threading.Thread(target=self._read, args=(name, proc), daemon=True, name=f"read-{name}").start()
        return proc

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                self.reports.put((name, json.loads(line)))
            except json.JSONDecodeError:  # something else printed: kept apart from the child's log
                with (self.logs / f"{name}.stdout.log").open("a") as f:
                    f.write(line)

    def next_report(self, timeout_s: float) -> tuple[str, dict] | None:
        try:
            return self.reports.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def check_alive(self, names) -> None:
        dead = {n: self.procs[n].returncode for n in names if self.procs[n].poll() is not None}
        if dead:
            raise ChildFailed(f"child processes exited: {dead}\n{self.tails(dead)}")

    def tails(self, names=None, chars: int = 2000) -> str:
        names = sorted(self.procs) if names is None else sorted(names)
        out = []
        for n in names:
            path = self.logs / f"{n}.log"
            text = path.read_text(errors="replace")[-chars:] if path.exists() else ""
            out.append(f"===== {n} ({path})\n{text}")
        return "\n".join(out)

    def wait(self, names, timeout_s: float) -> None:
        """Give ``names`` up to ``timeout_s`` to exit by themselves."""
        deadline = time.monotonic() + timeout_s
        for n in names:
            try:
                self.procs[n].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return

    def stop(self, names=None, timeout_s: float = 10.0) -> dict[str, int]:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit codes."""
        return stop({n: self.procs[n] for n in (self.procs if names is None else names)}, timeout_s)
