"""Start and stop stand-in SGLang servers (``sglang_server.py`` beside this file) as real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from april_async.runtime import free_port, spawn
from standins.flags import split_flags

ROOT = Path(__file__).resolve().parents[1]
"""The checkout, where ``python -m standins.sglang_server`` finds this package."""

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
"""One client for the calls tests make to stand-ins outside an engine (``HTTP.get(url, timeout=...)``):
making an httpx client loads the CA bundle, ~30 ms of CPU, which each ``httpx.get`` would pay
again (a third of a stand-in test module's own CPU went there). No connection is kept between
calls, as with a client per call: a call never meets a server killed since on a kept socket."""


@dataclass(eq=False)
class StandIn:
    url: str
    proc: subprocess.Popen
    log: Path

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=15)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def state(self) -> dict:
        """What clients can change on it, from its HTTP API: ``/v1/loads`` (running and waiting, as
        SGLang counts them) and the stand-in's ``/standin/state`` (every request it holds, the pause,
        weight version, a digest of the weights, weight-update groups and session, pending
        ``/standin/abort_next`` aborts, cache flushes)."""
        rows = HTTP.get(f"{self.url}/v1/loads", timeout=5.0).json()["loads"]  # [] with --no-load-snapshot
        return {"running": rows[0]["num_running_reqs"] if rows else None,
                "waiting": rows[0]["num_waiting_reqs"] if rows else None,
                **HTTP.get(f"{self.url}/standin/state", timeout=5.0).json()}


def start_standin(checkpoint: Path, log_dir: Path, *args: str, name: str = "standin",
                  timeout_s: float = 60.0, port: int | None = None, wait: bool = True) -> StandIn:
    """A stand-in on ``port`` (default: a free one), once it answers ``/model_info`` (``wait``; else at
    once, still starting: a server coming back, as clients meet it). The process ends with the
    thread that started it (``spawn``'s parent-death signal): start it from a thread that stays."""
    port = port or free_port()
    log = log_dir / f"{name}-{port}.log"
    proc = spawn([sys.executable, "-m", "standins.sglang_server", "--checkpoint", str(checkpoint),
                  "--port", str(port), *args], log=log, cwd=ROOT)
    s = StandIn(f"http://127.0.0.1:{port}", proc, log)
    if not wait:
        return s
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the stand-in exited ({proc.returncode}):\n{s.tail()}")
        try:
            if HTTP.get(f"{s.url}/model_info", timeout=1.0).status_code == 200:
                return s
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            s.kill()
            raise RuntimeError(f"the stand-in did not serve within {timeout_s:g} s:\n{s.tail()}")
        time.sleep(0.1)


PoolKey = tuple[Path, tuple[str, ...]]
"""(checkpoint, process flags): which pooled stand-ins are interchangeable."""


class StandinPool:
    """Stand-in servers kept from one test for the next that asks for the same checkpoint and
    process flags, so that each test does not pay for a process start (importing torch, loading the
    checkpoint). The flags of ``RUNTIME_FLAGS`` (delays, timeouts, the SGLang version it plays) are
    set on a kept server with ``/standin/configure`` instead: it then behaves as one started with
    them, and ``/standin/reset`` puts back those it started with.

    A server is handed out only while it is provably as it started: alive, and its ``state()`` read
    over HTTP equal to the one it had before first use (nothing running or waiting, not paused, the
    same weights and weight version, no weight-update group or session, no test hook pending, no
    cache flush). A server given back changed (pushed to, paused) is first reset
    (``/standin/reset``: refused while it holds requests or groups); one still not as it started is
    killed, and a fresh one started in its place. That is checked when a test gives it back and
    again when one takes it. ``close`` kills what the pool holds."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.idle: dict[PoolKey, list[StandIn]] = {}
        self.started: dict[StandIn, tuple[PoolKey, dict]] = {}  # each live one: its key, its initial state

    def take(self, checkpoint: Path, *args: str) -> StandIn:
        """A stand-in of ``checkpoint`` as if just started with ``args``."""
        start, runtime = split_flags(args)
        key = (checkpoint, start)
        idle = self.idle.get(key, [])
        while idle and not self.as_started(idle[-1]):
            self.discard(idle.pop())
        if idle:
            s = idle.pop()
        else:
            s = start_standin(checkpoint, self.log_dir, *start)
            self.started[s] = (key, s.state())
        if runtime:
            answer = HTTP.post(f"{s.url}/standin/configure", json={"argv": list(runtime)}, timeout=10.0)
            if answer.status_code != 200:  # a harness error (a flag it cannot set): say so, keep nothing
                self.discard(s)
                raise RuntimeError(f"stand-in {s.url} refused /standin/configure {list(runtime)}: "
                                   f"{answer.text}")
        return s

    def give_back(self, s: StandIn) -> None:
        """Keep ``s`` for a later ``take`` if it is as it started, or is once reset; else kill it."""
        if self.as_started(s) or (s.proc.poll() is None and self.reset(s) and self.as_started(s)):
            self.idle.setdefault(self.started[s][0], []).append(s)
        else:
            self.discard(s)

    def as_started(self, s: StandIn) -> bool:
        """Alive, and ``state()`` as it was before its first use."""
        if s.proc.poll() is not None:
            return False
        try:
            return s.state() == self.started[s][1]
        except httpx.HTTPError:
            return False

    @staticmethod
    def reset(s: StandIn) -> bool:
        try:
            return HTTP.post(f"{s.url}/standin/reset", json={}, timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def discard(self, s: StandIn) -> None:
        del self.started[s]
        s.kill()

    def close(self) -> None:
        for s in list(self.started):
            self.discard(s)
        self.idle.clear()
