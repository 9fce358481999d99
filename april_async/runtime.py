"""What every actor process shares: a stop flag set by SIGINT/SIGTERM, the error that stops one, the
common run of an actor (``run_actor``), and the tie that makes a child process die with its parent."""

from __future__ import annotations

import os
import signal
import threading


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


class ActorFailed(RuntimeError):
    """Raised out of an actor's loop for a failure that retrying cannot mend (a server that refuses
    every request as configured); the actor's command prints it and exits with status 2."""


def run_actor(command: str, cfg, build, stop: StopFlag) -> int:
    """``april <command>`` once its config ``cfg`` is resolved: set up logging (``cfg.log``), build the
    actor (``build(cfg)``, from ``<actor>/main.py``) and run it until ``stop``. Returns 0, or 2 after one
    line naming what stopped it: a setting that only fails when used (a reward path, a journal
    directory: ``ValueError``, ``OSError``) or a peer that refuses its work for good (``ActorFailed``)."""
    import sys

    from april_async.logs import configure

    configure(json=cfg.log.json_lines, level=cfg.log.level)
    try:
        actor = build(cfg)
    except (ValueError, OSError) as e:
        print(f"april {command}: {e}", file=sys.stderr)
        return 2
    try:
        actor.run(stop)
    except ActorFailed as e:
        print(f"april {command}: {e}", file=sys.stderr)
        return 2
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
