"""``april up``'s console: its stdout and stderr on a terminal that may go away, and the log they also go to."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class SafeStream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` while ``april up`` runs: a terminal that may vanish under it.

    Under ``launch/cluster.sh`` the terminal is ssh's: when ssh closes, the next write fails with
    EIO; behind ``| head`` it fails with EPIPE. A supervisor that raised there would skip its ordered
    stop and its summary and leave the children to die at once by PDEATHSIG, so the first failure
    ends this stream's console for good and nothing here ever raises. What the terminal shows also
    goes to the log (``attach``), so nothing is lost with it.
    """

    def __init__(self, inner: IO[str]):
        self.inner = inner
        self.lost = False
        self.log: IO[str] | None = None

    def write(self, text: str) -> int:
        if self.log is not None:
            try:
                self.log.write(text)
            except (OSError, ValueError):  # a full disk must not stop the run either
                self.log = None
        if not self.lost:
            try:
                self.inner.write(text)
                self.inner.flush()  # few lines, each shown at once; a gone terminal is found at once
            except OSError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.flush()

    def isatty(self) -> bool:
        return not self.lost and self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.inner, "encoding", "utf-8")

    def _lose(self) -> None:
        """Stop writing to the terminal, and point its descriptor at /dev/null long enough to drain what
        the failed write left buffered: Python's own flush of the stream at exit then succeeds (a
        failing one makes the exit status 120). Afterwards the descriptor points at the log, so that
        whatever else writes there (a traceback) is kept."""
        self.lost = True
        try:
            fd = self.inner.fileno()
        except (OSError, ValueError, io.UnsupportedOperation):
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self.inner.flush()
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                os.dup2(self.log.fileno(), fd)


@dataclass
class Console:
    """``april up``'s stdout and stderr as ``SafeStream`` s, and the log both also go to."""

    out: SafeStream
    err: SafeStream

    def attach(self, path: Path) -> None:
        """Append everything shown from now on to ``path`` too (``<run.dir>/logs/up[-<node>].log``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        log = path.open("a", buffering=1)  # a line at a time: the log is what is left if the terminal goes
        self.out.log = self.err.log = log


@contextlib.contextmanager
def safe_console() -> Iterator[Console]:
    """``sys.stdout`` and ``sys.stderr`` replaced by ``SafeStream`` s while the block runs (then put back,
    for callers in the same process; a lost terminal's descriptor stays on the log or /dev/null)."""
    saved = sys.stdout, sys.stderr
    console = Console(SafeStream(sys.stdout), SafeStream(sys.stderr))
    sys.stdout, sys.stderr = console.out, console.err
    try:
        yield console
    finally:
        sys.stdout, sys.stderr = saved
        log = console.out.log
        console.out.log = console.err.log = None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()
