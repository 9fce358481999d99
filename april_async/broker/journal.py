"""The broker's write-ahead journal: an append-only log in segments, plus snapshots.

Layout of the directory::

    snapshot-000003.bin   the core's state after every record of segments < 3
    log-000003.bin        records appended since that snapshot (the current segment)

A record is ``[u32 length][u32 crc32][payload]``, little-endian; the broker's payloads are the
typed records of ``records.py`` (this file only frames bytes). ``snapshot()`` writes the new
snapshot to a temporary file, fsyncs it, renames it into place and fsyncs the directory, then
starts a new segment and deletes older segments and snapshots: at every moment the newest
complete snapshot plus the segments after it hold the whole state.

Recovery takes the newest snapshot and replays the segments from its number on, in order. A
torn or corrupt record at the very end of the last segment (``kill -9`` in the middle of a
write) is cut off and counted; damage anywhere else raises ``JournalCorrupt`` naming the file
and offset, because silently skipping a record would break the replay. (A damaged *length*
field that points past the end of the last segment cannot be told from a torn write, and is
cut off like one.)

Group commit: ``append`` queues a record in memory and ``commit`` writes every queued record
with one ``os.write`` on an ``O_APPEND`` descriptor. The broker commits before it sends anything
that a record caused, and after each batch of messages, so nothing the outside world has seen
depends on an uncommitted record (write-ahead). A committed record survives ``kill -9`` of the
process in every mode. What fsync adds is survival of a power loss or kernel crash:

- ``always``: fsync after every record (slowest; nothing acknowledged is ever lost);
- ``interval`` (the default, every 50 ms): a power loss loses at most the last interval;
- ``none``: never fsync; the OS writes back when it likes.

``durable_count`` is the number of records that survive what the mode protects against: with
``always`` and ``interval`` the records fsynced so far, with ``none`` the records committed. The
broker acknowledges a peer's messages only up to it.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from pathlib import Path
from typing import Literal

HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 256 * 1024 * 1024
_NAME = re.compile(r"^(log|snapshot)-(\d{6})\.bin$")


class JournalError(ValueError):
    """The journal cannot be used (a bad directory, a record too large)."""


class JournalCorrupt(JournalError):
    """A record before the end of the journal is damaged; the message names the file and offset."""


class Journal:
    def __init__(self, directory: Path, durability: Literal["always", "interval", "none"] = "interval",
                 interval_s: float = 0.05):
        if durability not in ("always", "interval", "none"):
            raise JournalError(f"durability must be always, interval or none, got {durability!r}")
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise JournalError(f"journal path {str(self.dir)!r} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.durability, self.interval_s = durability, interval_s
        self.segment = 0
        self._fd: int | None = None
        self.records_appended = 0  # this process's records (after recovery)
        self.bytes_appended = 0
        self.fsyncs = 0
        self.snapshots_written = 0
        self.recovered_records = 0
        self.recovered_torn = 0
        self._synced = 0
        self._written = 0
        self._pending: list[bytes] = []
        self._last_sync = 0.0

    # ------------------------------------------------------------------ files

    def _files(self, kind: str) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.iterdir():
            match = _NAME.match(p.name)
            if match and match.group(1) == kind:
                out.append((int(match.group(2)), p))
        return sorted(out)

    def _path(self, kind: str, number: int) -> Path:
        return self.dir / f"{kind}-{number:06d}.bin"

    def _open_segment(self, number: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self.segment = number
        self._fd = os.open(self._path("log", number), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    # ------------------------------------------------------------------ recovery

    def recover(self) -> tuple[bytes | None, list[bytes]]:
        """The newest snapshot (or None) and every record after it; opens the journal for appends."""
        for leftover in self.dir.glob("*.tmp"):
            leftover.unlink()
        snapshots = self._files("snapshot")
        snapshot, base = (snapshots[-1][1].read_bytes(), snapshots[-1][0]) if snapshots else (None, 0)
        segments = [(n, p) for n, p in self._files("log") if n >= base]
        records: list[bytes] = []
        for i, (_, path) in enumerate(segments):
            records += self._read_segment(path, last=i == len(segments) - 1)
        self.recovered_records = len(records)
        self._open_segment(segments[-1][0] if segments else base)
        self._synced = self._written = self.records_appended = 0
        return snapshot, records

    def _read_segment(self, path: Path, *, last: bool) -> list[bytes]:
        data = path.read_bytes()
        records, pos = [], 0
        while pos < len(data):
            problem = None
            if pos + HEADER.size > len(data):
                problem = "a truncated record header"
            else:
                length, crc = HEADER.unpack_from(data, pos)
                end = pos + HEADER.size + length
                if length > MAX_RECORD_BYTES or end > len(data):
                    problem = f"a record of {length} bytes running past the end"
                elif zlib.crc32(data[pos + HEADER.size : end]) != crc:
                    problem = "a record whose checksum does not match"
            if problem is not None:
                if last and self._is_tail(data, pos):
                    with open(path, "r+b") as f:  # cut the torn tail off
                        f.truncate(pos)
                    self.recovered_torn += 1
                    return records
                raise JournalCorrupt(f"{path}: {problem} at byte {pos}")
            records.append(data[pos + HEADER.size : end])
            pos = end
        return records

    @staticmethod
    def _is_tail(data: bytes, pos: int) -> bool:
        """Could the bytes from ``pos`` be one record whose write was interrupted?"""
        if pos + HEADER.size > len(data):
            return True
        length, _ = HEADER.unpack_from(data, pos)
        return pos + HEADER.size + length >= len(data)

    # ------------------------------------------------------------------ writing

    def append(self, record: bytes) -> None:
        if self._fd is None:
            raise JournalError("call recover() before append()")
        if len(record) > MAX_RECORD_BYTES:
            raise JournalError(f"record of {len(record)} bytes is over the limit of {MAX_RECORD_BYTES}")
        self._pending.append(HEADER.pack(len(record), zlib.crc32(record)))
        self._pending.append(record)
        self.records_appended += 1

    def commit(self) -> None:
        """Write every queued record (one system call); with ``always``, fsync them too."""
        if not self._pending:
            return
        buf = b"".join(self._pending)
        self._pending.clear()
        written = os.write(self._fd, buf)
        if written != len(buf):  # O_APPEND regular files write whole; anything else is a disk problem
            raise JournalError(f"short write to {self._path('log', self.segment)}: {written} of {len(buf)} bytes")
        self.bytes_appended += len(buf)
        self._written = self.records_appended
        if self.durability == "always":
            os.fsync(self._fd)
            self.fsyncs += 1
            self._synced = self._written

    def maybe_flush(self, now: float) -> None:
        """Commit; with ``interval``, fsync when ``interval_s`` has passed and records wait."""
        self.commit()
        if self.durability == "interval" and self._synced < self._written and now - self._last_sync >= self.interval_s:
            self.flush()
            self._last_sync = now

    def flush(self) -> None:
        """Commit and fsync."""
        if self._fd is None:
            return
        self.commit()
        if self._synced < self._written:
            os.fsync(self._fd)
            self.fsyncs += 1
            self._synced = self._written

    @property
    def durable_count(self) -> int:
        """Records (of this process) that survive what the durability mode protects against."""
        return self._written if self.durability == "none" else self._synced

    def snapshot(self, state: bytes) -> None:
        """Write ``state`` (everything up to now) and start a new segment; drop what it replaces."""
        self.flush()
        number = self.segment + 1
        final = self._path("snapshot", number)
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._open_segment(number)
        for n, p in self._files("log") + self._files("snapshot"):
            if n < number:
                p.unlink()
        self.snapshots_written += 1

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None
