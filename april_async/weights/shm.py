"""Shared-memory regions for the learner → broadcaster hand-off on one host (protocol 1.7).

A version's flat buffer (``weights.flat``) need not travel over loopback TCP when the learner and
the broadcaster share a host: the learner writes it into a region both processes map, and its
``weights_update`` names the region (``SharedRegion``: kind, name, offset, nbytes, generation)
instead of carrying the bytes. The broadcaster broadcasts straight from its mapping.

Three operations, one per side of the region's life:

- **export** (the owner, ``ShmRegion``): ``create(name, nbytes)`` makes the region, the owner
  writes a version into ``data`` between ``begin_write()`` and ``export(version)``, which returns
  the handle to send. ``export`` bumps the region's generation, also written in a header at the
  start of the region, so that a reader can tell the bytes it maps from the ones a handle named.
- **open** (the reader, ``open_region``): maps the region a handle names and checks its header
  (magic, generation, size). ``MappedRegion.still_valid()`` reads the header again: a generation
  that moved means the owner is writing over the bytes, which must then not be used.
- **release** (the reader, ``MappedRegion.release``): the reader no longer reads the bytes; it
  tells the owner so on the wire (the broadcaster lists the regions it still reads in its
  heartbeats to the learner), and only then may the owner write into the region again.

The CPU kind, ``posix_shm``, is a file in ``/dev/shm`` (tmpfs) mapped with ``mmap``: plain files
rather than ``multiprocessing.shared_memory``, whose resource tracker unlinks segments behind the
owner's back when any process that attached to them exits. The file is allocated in full at
creation (``posix_fallocate``), so a tmpfs too small for it is a ``RegionError`` then and never a
``SIGBUS`` on a write later. Names are ``april-w-<instance>-<pid>-<n>``: never reused by one
process, and a restarted owner removes the names of its instance whose process is gone
(``remove_stale``); the owner unlinks its names when it closes, and as soon as the reader has
mapped a region (``ShmRegion.unlink``: both mappings stay valid, and the memory goes when the
last one is dropped), so a process killed later leaks nothing. A reader opens only names of that
pattern, in ``/dev/shm``: a handle cannot make it map any other file.

On a GPU the same three operations take a CUDA IPC handle in place of a file: export would be
``tensor.untyped_storage()._share_cuda_()`` (the tuple then goes in the handle, a kind
``cuda_ipc``), open ``torch.UntypedStorage._new_shared_cuda(*handle)`` in the broadcaster (or
``torch.multiprocessing``'s reductions, which wrap both), and release the reader dropping its
storage after a CUDA event has told it that its broadcast read everything. That kind is not
written here (no GPU where this was written); a reader refuses a kind it does not know with a
``RegionError``, and the learner then hands its versions over as bytes.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from pathlib import Path

import numpy as np
import torch

from april_async.wire.messages import SharedRegion

SHM_DIR = Path("/dev/shm")
KIND = "posix_shm"
PREFIX = "april-w-"
HEADER_BYTES = 4096
"""The data of a region starts here: after the header, page-aligned."""
_HEADER = struct.Struct("<8sQQq")  # magic, generation, nbytes, version
MAGIC = b"APRILWS1"
_NAME = re.compile(r"^april-w-[A-Za-z0-9_.-]{1,80}-(\d+)-(\d+)$")


class RegionError(RuntimeError):
    """A shared-memory region that cannot be made, opened or trusted: the message names it and
    says why. The hand-off falls back to sending the bytes."""


def host_id() -> str | None:
    """This host's identity for shared memory: the kernel's boot id and the device of
    ``/dev/shm`` (two containers on one kernel with separate tmpfs mounts differ); None where
    there is no ``/dev/shm``."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return None
    return f"{boot}/{dev}"


def _safe(instance: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", instance)[:60] or "x"


def remove_stale(instance: str) -> list[str]:
    """Unlink the regions of ``instance`` left by processes that no longer run (a learner killed
    with SIGKILL); returns their names. Regions of live processes are left alone."""
    removed = []
    try:
        entries = list(SHM_DIR.iterdir())
    except OSError:
        return removed
    for path in entries:
        name = path.name
        if not name.startswith(f"{PREFIX}{_safe(instance)}-"):
            continue
        match = _NAME.match(name)
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class ShmRegion:
    """The owner's side of one ``posix_shm`` region of ``nbytes`` (``data``: writable, 1-D uint8)."""

    _made = 0  # regions made by this process: the last part of each name

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = nbytes
        self.generation = 0
        self.linked = True
        path = SHM_DIR / name
        # A tmpfs is memory: filling it takes the host's RAM page by page until the allocation
        # fails, and other processes may be killed on the way. So a region that cannot fit in what
        # is free now is refused before anything is allocated (fallocate below still catches a race).
        try:
            st = os.statvfs(SHM_DIR)
        except OSError as e:
            raise RegionError(f"cannot read the free space of {SHM_DIR}: {e}") from e
        free = st.f_bavail * st.f_frsize
        if HEADER_BYTES + nbytes > free:
            raise RegionError(f"cannot allocate {HEADER_BYTES + nbytes} bytes for shared-memory region {path}: "
                              f"only {free} bytes are free on {SHM_DIR}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise RegionError(f"cannot create shared-memory region {path}: {e}") from e
        try:
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)  # ENOSPC now, not SIGBUS on a write
            except OSError as e:
                raise RegionError(f"cannot allocate {HEADER_BYTES + nbytes} bytes for shared-memory region "
                                  f"{path}: {e}") from e
            self._map = mmap.mmap(fd, HEADER_BYTES + nbytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.data = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        self._write_header(0, -1)

    @classmethod
    def create(cls, instance: str, nbytes: int) -> ShmRegion:
        """A new region named after ``instance``, this process and a counter."""
        cls._made += 1
        return cls(f"{PREFIX}{_safe(instance)}-{os.getpid()}-{cls._made}", nbytes)

    @property
    def tensor(self) -> torch.Tensor:
        """``data`` as a uint8 tensor (no copy), e.g. the ``out`` of ``flat.flatten``."""
        return torch.from_numpy(self.data)

    def _write_header(self, generation: int, version: int) -> None:
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, generation, self.nbytes, version)

    def begin_write(self) -> None:
        """The bytes are about to change: a reader checking the header now sees generation 0."""
        self._write_header(0, -1)

    def export(self, version: int) -> SharedRegion:
        """The bytes written since ``begin_write`` are ``version``: a new generation, and its handle."""
        self.generation += 1
        self._write_header(self.generation, version)
        return SharedRegion(kind=KIND, name=self.name, offset=HEADER_BYTES, nbytes=self.nbytes,
                            generation=self.generation)

    def unlink(self) -> None:
        """Remove the name (idempotent); mappings, this one included, stay valid."""
        if self.linked:
            self.linked = False
            (SHM_DIR / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Unlink the name and drop this mapping (once no view of ``data`` is left)."""
        self.unlink()
        self.data = None
        try:
            self._map.close()
        except BufferError:  # a view of the bytes still lives somewhere: the mapping goes with it
            pass


class MappedRegion:
    """The reader's mapping of a region a handle named: ``array`` (1-D uint8; the reader only reads it)."""

    def __init__(self, handle: SharedRegion, mapping: mmap.mmap):
        self.handle = handle
        self._map = mapping
        self.array = np.frombuffer(mapping, dtype=np.uint8, count=handle.nbytes, offset=handle.offset)

    def header(self) -> tuple[bytes, int, int, int]:
        """(magic, generation, nbytes, version) as the owner last wrote them."""
        return _HEADER.unpack_from(self._map, 0)

    def still_valid(self) -> bool:
        """The owner has not begun another write into the region since the handle's export."""
        magic, generation, nbytes, _ = self.header()
        return magic == MAGIC and generation == self.handle.generation and nbytes == self.handle.nbytes

    def release(self) -> None:
        """This reader no longer reads the bytes (the mapping goes once no view of it is left)."""
        self.array = None


class RegionCache:
    """The reader's mappings by name, so that a region the owner writes version after version is
    mapped (and its pages faulted in) once. At most ``keep`` names are kept."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._maps: dict[str, mmap.mmap] = {}

    def open(self, handle: SharedRegion) -> MappedRegion:
        """The region ``handle`` names, checked; a ``RegionError`` naming it and why otherwise."""
        if handle.kind != KIND:
            raise RegionError(f"region kind {handle.kind!r} is not supported here (only {KIND!r})")
        if _NAME.match(handle.name) is None:
            raise RegionError(f"region name {handle.name!r} is not of the form {PREFIX}<instance>-<pid>-<n>")
        end = handle.offset + handle.nbytes
        mapping = self._maps.get(handle.name)
        if mapping is None or len(mapping) < end:
            path = SHM_DIR / handle.name
            try:
                fd = os.open(path, os.O_RDWR)  # mapped writable: gloo's root is never handed read-only memory
            except OSError as e:
                raise RegionError(f"cannot open shared-memory region {path}: {e}") from e
            try:
                size = os.fstat(fd).st_size
                if size < end or handle.offset < HEADER_BYTES:
                    raise RegionError(f"shared-memory region {path} has {size} bytes; the handle names "
                                      f"[{handle.offset}, {end})")
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._maps[handle.name] = mapping
            while len(self._maps) > self.keep:
                del self._maps[next(iter(self._maps))]  # the oldest: its views keep it mapped while used
        region = MappedRegion(handle, mapping)
        if not region.still_valid():
            magic, generation, nbytes, _ = region.header()
            region.release()
            raise RegionError(f"shared-memory region {handle.name} holds generation {generation} of {nbytes} bytes "
                              f"(magic {magic!r}); the handle names generation {handle.generation} of "
                              f"{handle.nbytes}")
        return region

    def clear(self) -> None:
        self._maps.clear()


def open_region(handle: SharedRegion) -> MappedRegion:
    """Map the region ``handle`` names, once (see ``RegionCache`` to map a name once for many)."""
    return RegionCache(keep=1).open(handle)
