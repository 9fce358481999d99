"""Child processes for tests: ``april_async.runtime``'s helpers (free ports, children that die with
their parent), with the checkout as the children's directory, and waiting on what they do."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from april_async import runtime
from april_async.runtime import FREE_PORTS, ChildFailed, free_port, stop

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (children run from it, so that ``tools/`` and ``python -m`` find the same files)."""

spawn = functools.partial(runtime.spawn, cwd=ROOT)
"""``runtime.spawn`` from the checkout."""


def load_tool(name: str):
    """``tools/<name>.py`` as a module (the tools are scripts, not a package), registered in
    ``sys.modules`` under ``<name>_tool`` first: its dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def worker_ports(ports: range, worker: str, count: int) -> range:
    """The slice of ``ports`` that pytest-xdist worker ``worker`` (``gw0``, ``gw1``, ...) of ``count``
    picks from; the slices of ``count`` workers do not overlap."""
    index, size = int(worker.removeprefix("gw")), len(ports) // count
    if not 0 <= index < count or size == 0:
        raise ValueError(f"worker {worker!r} of {count}: no slice of ports {ports.start}-{ports.stop - 1}")
    return range(ports.start + index * size, ports.start + (index + 1) * size)


def wait_for(what: str, cond: Callable[[], object], timeout: float, proc: subprocess.Popen | None = None,
             log: Path | None = None, *, alive: Callable[[], None] | None = None, logs: Callable[[], str] | None = None,
             pump: Callable[[], None] | None = None, interval_s: float = 0.1) -> None:
    """Poll ``cond()`` until it holds, calling ``pump()`` between polls; fail naming ``what`` if
    ``proc`` (an ``april up``) exits first, if ``alive()`` raises, or once ``timeout`` seconds have
    passed. A failure shows the end of ``log`` (or what ``logs()`` returns)."""

    def tail() -> str:
        return log.read_text(errors="replace")[-4000:] if log is not None else (logs() if logs else "")

    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"april up exited ({proc.returncode}) before {what}:\n{tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s:\n{tail()}")
        if alive is not None:
            alive()
        if pump is not None:
            pump()
        time.sleep(interval_s)


__all__ = ["FREE_PORTS", "ROOT", "ChildFailed", "free_port", "load_tool", "spawn", "stop", "wait_for",
           "worker_ports"]
