"""A gloo group with NCCL's host-side semantics, for tests of the weight push (NCCL needs GPUs).

``BACKEND`` (``gloo_nccl_semantics``) is a ``torch.distributed`` backend whose collectives travel
over a real gloo group but whose calls behave, on the host, as NCCL's do (torch's
``ProcessGroupNCCL``); it is a **stand-in**, named so, for what CPU machines cannot run:

- a collective is queued and its call returns: on the source rank of a broadcast ``wait()``
  returns at once, whether or not any receiver posted its receive (NCCL's ``wait`` only orders the
  caller's CUDA stream after the kernel). On the other ranks ``wait()`` blocks until the data is
  there, as any stream-ordered use of it would;
- a collective that has not completed by the group's timeout is caught by a *watchdog* thread:
  recorded in ``WATCHDOG`` and logged, the group is broken (every later call raises). Real NCCL's
  watchdog then tears the process down by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``);
- ``abort()`` ends what is queued at once (``ncclCommAbort``): nothing is left for the watchdog;
- ``shutdown()`` (what ``destroy_process_group`` calls) is graceful: it waits for every queued
  collective to finish, so it waits for the watchdog where one never will (torch's
  ``ProcessGroupNCCL::shutdown``: "will wait for all NCCL kernels to finish before destroying
  communicators", unlike ``abort``).

Only broadcast is implemented, the one collective of SGLang's weight-update group. ``register()``
makes the name known to ``torch.distributed`` in this process; the stand-in server does it under
``--nccl-semantics``, and a test or tool does it for its rank 0.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

BACKEND = "gloo_nccl_semantics"
WATCHDOG: list[str] = []
"""One line per collective the watchdog caught in this process (where NCCL would have ended it)."""
TICK_S = 0.02


class QueuedWork(dist.Work):
    """One queued collective: the gloo work under it, and what the host may ask of it."""

    def __init__(self, group: NcclSemanticsGroup, inner, source: bool, what: str):
        super().__init__()
        self.group, self.inner, self.source, self.what = group, inner, source, what
        self.started = time.monotonic()
        self.aborted = self.timed_out = False

    def delivered(self) -> bool:
        """Whether the gloo work under it finished *well*. One that failed because a peer left
        (destroyed its end, died) is still queued here: an NCCL kernel waiting for a peer's data
        is not told that the peer's process went away (over shared memory or P2P nothing tells it)."""
        return self.inner.is_completed() and self.inner.is_success()

    def is_completed(self) -> bool:
        return self.aborted or self.timed_out or self.delivered()

    def is_success(self) -> bool:
        return not (self.aborted or self.timed_out) and self.delivered()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.aborted or self.timed_out:
            raise RuntimeError(f"{self.what}: the communicator was aborted")
        if self.source:  # NCCL: the host does not wait for the kernel
            return True
        return self.inner.wait()  # the data is used after it arrives; gloo's own timeout bounds it


class NcclSemanticsGroup(dist.ProcessGroup):
    """A process group of ``BACKEND``: gloo underneath, NCCL's host-side behaviour on top."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self.gloo = ProcessGroupGloo(store, rank, size, timeout)
        self.timeout_s = timeout.total_seconds()
        self.me = rank
        self.queued: list[QueuedWork] = []
        self.broken: str | None = None
        self.cv = threading.Condition()
        self.closed = False
        self.watchdog = threading.Thread(target=self._watch, daemon=True, name="nccl-semantics-watchdog")
        self.watchdog.start()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def broadcast(self, tensors, opts):
        with self.cv:
            if self.broken is not None:
                raise RuntimeError(f"broadcast on a broken communicator: {self.broken}")
            work = QueuedWork(self, self.gloo.broadcast(tensors, opts), opts.rootRank == self.me,
                              f"broadcast of {sum(t.numel() * t.element_size() for t in tensors)} bytes "
                              f"from rank {opts.rootRank}")
            self.queued.append(work)
            return work

    def _watch(self) -> None:
        while True:
            with self.cv:
                if self.closed:
                    return
                now = time.monotonic()
                for work in list(self.queued):
                    if work.delivered():
                        self.queued.remove(work)
                    elif now - work.started > self.timeout_s:
                        work.timed_out = True
                        self.queued.remove(work)
                        self.broken = (f"watchdog: {work.what} not done after {self.timeout_s:g} s "
                                       f"(rank {self.me}); NCCL's watchdog would now end this process")
                        WATCHDOG.append(self.broken)
                        print(self.broken, file=sys.stderr, flush=True)
                self.cv.notify_all()
                self.cv.wait(TICK_S)

    def abort(self) -> None:
        """``ncclCommAbort``: what is queued ends now, failed; nothing is left for the watchdog."""
        with self.cv:
            for work in self.queued:
                work.aborted = True
            self.queued.clear()
            self.broken = self.broken or "aborted"
            self.closed = True
            self.cv.notify_all()

    def shutdown(self) -> None:
        """Graceful, as NCCL's: wait for every queued collective (or the watchdog) first."""
        with self.cv:
            self.cv.wait_for(lambda: not self.queued)
            self.closed = True
            self.cv.notify_all()


def _create(store, rank: int, size: int, timeout: datetime.timedelta) -> NcclSemanticsGroup:
    return NcclSemanticsGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``BACKEND`` known to ``torch.distributed`` in this process (once)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
