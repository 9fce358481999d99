"""What every process shares: a stop flag set by SIGINT/SIGTERM, the error that stops an actor, the
common run of an actor (``run_actor``) and its process's end (``exit_process``), the process's
incarnation that its hellos state (``incarnation``), the tie that makes a
child process die with its parent, and the one way tools and tests start child processes (``spawn``,
a group of them in ``Children``) and pick a free port for them (``free_port``)."""

from __future__ import annotations

import functools
import gc
import json
import os
import queue
import random
import secrets
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn


class StopFlag:
    """Set by SIGINT or SIGTERM; the actor's loop checks it between polls and shuts down cleanly."""

    def __init__(self, install: bool = True):
        self._event = threading.Event()
        self.signal: int | None = None
        if install:
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal = signum
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


_incarnation: tuple[int, str] | None = None


def incarnation() -> str:
    """This process's incarnation (protocol 1.8, ``hello.incarnation``): 64 random bits as 16 hex
    digits, drawn once per process (a forked child draws its own), so that a hub tells a process
    started again under the same instance name from the old one reconnecting."""
    global _incarnation
    pid = os.getpid()
    if _incarnation is None or _incarnation[0] != pid:
        _incarnation = (pid, secrets.token_hex(8))
    return _incarnation[1]


class ActorFailed(RuntimeError):
    """Raised out of an actor's loop for a failure that retrying cannot mend (a server that refuses
    every request as configured); the actor's command prints it and exits with status 2."""


def exit_process(code: int | str | None) -> NoReturn:
    """End this process as ``sys.exit(code)`` does, with a cheaper interpreter teardown: one full
    garbage collection now (cyclic garbage is finalised here instead of during the teardown), then
    ``gc.freeze()``, so that the teardown's own collections no longer walk every object alive now,
    the import graph of torch (and of transformers in a learner) above all. Threads are still joined,
    ``atexit`` handlers run and modules are torn down as at any exit; but an object that is alive
    now and in a reference cycle is never finalised (Python promises no finaliser at exit anyway):
    a file left open with bytes in its buffer (a module global, say) may lose them, so a process
    ends here only with its files closed or line-buffered, as every actor's are. The entry points
    of the processes a run starts end through it: ~0.3 s less CPU for a process that imported
    torch, ~0.7 s for a learner (2-core CPU machine). Never call it from a process that goes on."""
    gc.collect()
    gc.freeze()
    raise SystemExit(code)


STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on(sig: int = STACKS_SIGNAL) -> None:
    """On ``sig``, write every thread's Python stack to stderr (the actor's log) and go on running
    (``faulthandler.register``): what ``april up`` sends an actor that did not stop in time, before it
    kills it, so that its log says where it hung."""
    import faulthandler
    import sys

    faulthandler.register(sig, file=sys.stderr, all_threads=True, chain=False)


def run_actor(command: str, cfg, build, stop: StopFlag) -> int:
    """``april <command>`` once its config ``cfg`` is resolved: set up logging (``cfg.log``), build the
    actor (``build(cfg)``, from ``<actor>/main.py``) and run it until ``stop``. Returns 0, or 2 after one
    line naming what stopped it: a setting that only fails when used (a reward path, a journal
    directory: ``ValueError``, ``OSError``; a metrics port taken) or a peer that refuses its work for good
    (``ActorFailed``). With ``cfg.metrics.port`` set, the actor's Prometheus endpoint serves while it
    runs (``april_async.telemetry``)."""
    import sys

    from april_async.logs import configure

    configure(json=cfg.log.json_lines, level=cfg.log.level)
    dump_stacks_on(STACKS_SIGNAL)
    from april_async.logs import get_logger
    from april_async.telemetry import serve

    try:
        actor = build(cfg)
        instance = getattr(cfg, "name", command)
        endpoint = serve(getattr(cfg, "metrics", None), actor, role=command, instance=instance,
                         log=get_logger(actor=command, instance=instance))
    except (ValueError, OSError) as e:
        print(f"april {command}: {e}", file=sys.stderr)
        return 2
    try:
        actor.run(stop)
    except ActorFailed as e:
        print(f"april {command}: {e}", file=sys.stderr)
        return 2
    finally:
        # Stopped: a second stop request (SLURM's scancel signals every process of a job step, then
        # the actor's april up signals it again) must not kill the process while its interpreter
        # shuts down, where CPython has put SIGTERM back to its default: that exit would read -15.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if endpoint is not None:
            endpoint.close()
    return 0


def die_with_parent(sig: int = signal.SIGTERM, *, own_group: bool = False) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``; the
    parent is the *thread* that forked it), so that nothing outlives whoever started it. With
    ``own_group`` the process also leaves its parent's process group, so that Ctrl-C at a terminal
    reaches the parent only, which then stops its children in its own order.

    Call it in the child: as ``preexec_fn`` (between fork and exec: ``functools.partial`` for the
    arguments) or first thing in a ``multiprocessing`` target. Elsewhere than Linux it does nothing.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if own_group:
        os.setpgrp()


def resolve_device(setting: str, local_rank: int = 0):
    """The ``torch.device`` a device setting names (``config.Device``).

    ``auto`` is CUDA when torch sees a GPU, else the CPU. ``cuda`` (or ``auto`` on a GPU host) is
    GPU ``local_rank`` (a process's place on its host), so several ranks on one host each take
    their own; ``cuda:<i>`` is exactly GPU i. Asking for CUDA where there is none is an error
    naming the setting.
    """
    import torch

    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {setting!r}: torch sees no CUDA device here (torch {torch.__version__})")
    index = local_rank if setting == "cuda" else int(setting.partition(":")[2])
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {setting!r}: GPU {index} does not exist ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", index)


def exit_past_torch_teardown(code: int) -> None:
    """End a process that formed a ``torch.distributed`` group with ``code``, skipping the C++
    teardown: after the group was destroyed cleanly, torch 2.13 (gloo) sometimes aborts at
    interpreter exit ("terminate called without an active exception", status -6), which a
    supervisor would take for a crash. Python's own cleanup (files, logs) must be done already."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# ---------------------------------------------------------------------- child processes

FREE_PORTS = range(20000, 32000)
"""Where ``free_port`` looks unless ``APRIL_FREE_PORTS`` says otherwise: below the kernel's
ephemeral range (Linux: 32768-60999 by default). A port the kernel handed out for ``bind(0)`` was
freed for a child to bind later, and meanwhile any process binding port 0 (a test's own listener, a
ZeroMQ or gloo socket) could be given the same port: a broadcaster test's store failed so in a
fresh-clone CI run."""

PORTS_ENV = "APRIL_FREE_PORTS"
"""``LO-HI`` (inclusive): the ports ``free_port`` picks from in this process and the processes it
starts, instead of ``FREE_PORTS``. Two tools or test workers on one host that pick ports for
children they have not started yet can pick the same one; disjoint ranges make that impossible
(``tests/conftest.py`` gives each pytest-xdist worker its own)."""

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port_range() -> range:
    """The ports ``free_port`` picks from: ``APRIL_FREE_PORTS`` when set, else ``FREE_PORTS``."""
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return FREE_PORTS
    try:
        lo, hi = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ValueError(f"{PORTS_ENV}={spec!r} is not LO-HI, two ports such as 20000-23999") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"{PORTS_ENV}={spec!r}: want 1024 <= LO <= HI <= 65535")
    return range(lo, hi + 1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range, so
    that no ``bind(0)`` takes it before the caller's child binds it.

    One process hands out no port twice (until half the range has been handed out, when it starts
    over): a test that picked the broker's port, and the broadcaster's store port before the broker
    had bound the first, was given the same port twice in a CI run, and its broadcaster could not
    listen."""
    ports = free_port_range()
    rng = random.Random()  # not the global generator, which tests seed
    with _handed_out_lock:
        if 2 * len(_handed_out.intersection(ports)) >= len(ports):
            _handed_out.difference_update(ports)  # a long-lived process: its first children bound theirs
        for _ in range(200):
            port = rng.choice(ports)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {ports.start}-{ports.stop - 1} after 200 tries")


def spawn(cmd: list[str], *, log: Path | None = None, stdout=None, stdin=None, cwd: Path | str | None = None,
          env: dict[str, str] | None = None, own_group: bool = False, tied: bool = True,
          text: bool = False) -> subprocess.Popen:
    """Start ``cmd`` unbuffered (``PYTHONUNBUFFERED``), from ``cwd`` (default: this process's), with
    this process's environment and ``env`` over it.

    Its stdout and stderr go to the file ``log`` (its stdout elsewhere when ``stdout`` is given, e.g.
    ``subprocess.PIPE``); with no ``log`` they are this process's. ``tied`` (the default): it gets
    SIGTERM when the thread that started it dies (``die_with_parent``), so a crashed tool or test
    leaves nothing running; ``own_group`` also puts it in a process group of its own, out of reach
    of a Ctrl-C at the terminal. Every tool and test starts its child processes here."""
    preexec = functools.partial(die_with_parent, signal.SIGTERM, own_group=own_group) if tied else (
        os.setpgrp if own_group else None)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if log is None:
        return subprocess.Popen(cmd, stdout=stdout, stdin=stdin, cwd=cwd, env=env, text=text, preexec_fn=preexec)
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out if stdout is None else stdout, stderr=out, stdin=stdin, cwd=cwd,
                                env=env, text=text, preexec_fn=preexec)


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
    """A group of child processes, each with a log under ``logs``: started (from ``cwd``), watched,
    stopped together. A child started with ``reports=True`` writes one JSON object per line on its
    stdout; they arrive, as ``(name, object)``, in ``reports``."""

    logs: Path
    cwd: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    reports: queue.Queue = field(default_factory=queue.Queue)
    pids: list[int] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], *, reports: bool) -> subprocess.Popen:
        proc = spawn(cmd, log=self.logs / f"{name}.log", stdout=subprocess.PIPE if reports else None,
                     cwd=self.cwd, own_group=True, text=True)
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
