"""What every actor process shares: a stop flag set by SIGINT/SIGTERM, and the error that stops one."""

from __future__ import annotations

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
