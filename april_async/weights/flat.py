"""Weights as one flat byte buffer: a state dict <-> ``(list[TensorSpec], uint8 tensor)``.

This is the layout of ``weights_update`` and ``weights_announce`` (``proto/SPEC.md``): every
tensor's bytes, in native little-endian order, at the byte ``offset`` its ``TensorSpec`` names.

- ``layout`` places named tensors (name, dtype, shape) in a buffer without touching their bytes:
  each offset is rounded up to the tensor's element size, so a state dict of one dtype is packed
  back to back, and every tensor can later be viewed in place.
- ``flatten`` copies a state dict into one contiguous buffer laid out by ``layout`` (the only
  copy the hand-off makes): a new one, or the caller's own of the right size, reused.
- ``unflatten`` returns views into the buffer (no copy), with the dtype and shape of each spec.
  A tensor whose offset is not a multiple of its element size (another implementation may pack
  without padding) cannot be viewed and is copied out instead. A layout that does not fit the
  buffer — a tensor past its end, overlapping another, an unknown dtype, a repeated name — is a
  ``ValueError`` naming the tensor.
- ``buckets`` cuts ``num_bytes`` into consecutive ``bucket_bytes`` ranges (the last one shorter):
  the pieces the broadcaster sends one collective at a time.
- ``tensor_buckets`` cuts a layout at tensor boundaries instead, into ranges of whole tensors: the
  parts of a ``weights_update`` that a sharded learner gathers and sends one at a time, and the
  buckets the broadcaster pushes to SGLang's servers one update call at a time.
- ``bucket_digests`` hashes each of those ``buckets`` (``weights_announce.digests``, protocol 1.6),
  and ``check_digests`` compares a received buffer with them: a member refuses bytes that do not
  match what the broadcaster announced over the authenticated channel (``DigestMismatch``). Both
  take the announce's ``digest_alg`` (protocol 1.7): BLAKE2b-128, the default, or BLAKE3-128;
  ``digest`` is the one place either is computed, and a name it does not know is refused
  (``UnknownDigestAlg``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import blake3
import torch

from april_async.wire.messages import BLAKE2B_128, BLAKE3_128, DIGEST_ALGS, DIGEST_BYTES, TensorSpec

if sys.byteorder != "little":  # the wire layout is little-endian and we view tensors in place
    raise ImportError("april_async.weights.flat needs a little-endian host")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The wire's dtype names (``TensorSpec.dtype``) and their torch dtypes."""
_NAMES = {v: k for k, v in DTYPES.items()}


def _nbytes(spec: TensorSpec, dtype: torch.dtype) -> int:
    return math.prod(spec.shape) * dtype.itemsize


def layout(items: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[list[TensorSpec], int]:
    """Where each ``(name, dtype, shape)`` lies in a flat buffer, in the given order, and the
    buffer's size: each offset rounded up to the dtype's size (a view later needs it)."""
    specs: list[TensorSpec] = []
    offset = 0
    for name, dtype, shape in items:
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; the weights wire carries {sorted(DTYPES)}")
        offset = -(-offset // dtype.itemsize) * dtype.itemsize
        specs.append(TensorSpec(name, _NAMES[dtype], list(shape), offset))
        offset += math.prod(shape) * dtype.itemsize
    return specs, offset


def flatten(state_dict: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
            ) -> tuple[list[TensorSpec], torch.Tensor]:
    """Copy every tensor of ``state_dict`` into one 1-D uint8 CPU buffer; returns its layout too.

    The buffer is ``out`` when that is a contiguous 1-D uint8 CPU tensor of exactly the layout's
    size (a caller reusing the buffer of its last version: a new one of hundreds of MB faults in
    page by page while it is written), else a new one. The alignment padding between tensors is
    zeroed: left as it came from the allocator, or from the version before, it would send stray
    bytes over the wire, and make two copies of one version hash differently (``bucket_digests``)."""
    specs, num_bytes = layout((name, t.dtype, t.shape) for name, t in state_dict.items())
    reusable = (out is not None and out.dtype == torch.uint8 and out.dim() == 1 and out.is_contiguous()
                and out.device.type == "cpu" and out.numel() == num_bytes)
    buffer = out if reusable else torch.empty(num_bytes, dtype=torch.uint8)
    end = 0
    for spec, t in zip(specs, state_dict.values(), strict=True):
        buffer[end : spec.offset].zero_()
        n = t.numel() * t.element_size()
        if n:
            buffer[spec.offset : spec.offset + n].view(t.dtype).view(t.shape).copy_(t.detach())
        end = spec.offset + n
    return specs, buffer


def check_layout(specs: list[TensorSpec], num_bytes: int) -> None:
    """Raise ``ValueError`` naming the first tensor that does not fit a buffer of ``num_bytes``."""
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice in the layout")
        seen.add(spec.name)
        dtype = DTYPES.get(spec.dtype)
        if dtype is None:
            raise ValueError(f"tensor {spec.name!r} has dtype {spec.dtype!r}; known: {sorted(DTYPES)}")
        end = spec.offset + _nbytes(spec, dtype)
        if end > num_bytes:
            raise ValueError(f"tensor {spec.name!r} {spec.dtype}{spec.shape} at offset {spec.offset} ends at byte "
                             f"{end}, past the end of a {num_bytes}-byte buffer")
        if end > spec.offset:
            spans.append((spec.offset, end, spec.name))
    spans.sort()
    for (_, a_end, a), (b_start, _, b) in itertools.pairwise(spans):
        if b_start < a_end:
            raise ValueError(f"tensor {b!r} (from byte {b_start}) overlaps tensor {a!r} (to byte {a_end})")


def unflatten(specs: list[TensorSpec], buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors of ``specs`` as views into ``buffer`` (1-D uint8, any device), by name."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"the buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} of shape "
                         f"{tuple(buffer.shape)}")
    check_layout(specs, buffer.numel())
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        raw = buffer[spec.offset : spec.offset + _nbytes(spec, dtype)]
        if raw.storage_offset() % dtype.itemsize:  # packed without padding: a view would be misaligned
            raw = raw.clone()
        out[spec.name] = raw.view(dtype).view(spec.shape)
    return out


def buckets(num_bytes: int, bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``(start, stop)`` byte ranges of at most ``bucket_bytes`` covering ``num_bytes``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    for start in range(0, num_bytes, bucket_bytes):
        yield start, min(start + bucket_bytes, num_bytes)


def tensor_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[tuple[int, int, list[int]]]:
    """The layout ``specs`` cut at tensor boundaries: consecutive ``(start, stop, indices)`` byte
    ranges covering ``[0, end of the last tensor)``, each holding the specs (by index into
    ``specs``) that lie wholly inside it.

    Greedy, in offset order: a range takes tensors while it stays within ``bucket_bytes``; a
    range over ``bucket_bytes`` holds one tensor alone (one bigger than a bucket, or within a few
    bytes of it with its padding). The alignment padding before a tensor belongs to the range
    that holds the tensor, so every range starts where the one before it stops. Overlapping
    tensors (``check_layout``) are not cut apart and are not checked here."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[tuple[int, int, list[int]]] = []
    start = stop = 0
    inside: list[int] = []
    for i in sorted(range(len(specs)), key=lambda i: specs[i].offset):
        spec = specs[i]
        dtype = DTYPES.get(spec.dtype)
        if dtype is None:
            raise ValueError(f"tensor {spec.name!r} has dtype {spec.dtype!r}; known: {sorted(DTYPES)}")
        end = spec.offset + _nbytes(spec, dtype)
        if inside and max(stop, end) - start > bucket_bytes:
            out.append((start, stop, inside))
            start, inside = stop, []
        inside.append(i)
        stop = max(stop, end)
    if inside:
        out.append((start, stop, inside))
    return out


# ---------------------------------------------------------------------------------------------
# Digests of buckets (protocol 1.6; the algorithm named since 1.7)


class DigestMismatch(ValueError):
    """A received buffer that does not match the digests announced for it. ``bucket`` is the
    index of the first bucket whose bytes differ, ``expected`` and ``got`` its two digests; when
    the number of digests is wrong, ``bucket`` is None and the message gives both counts."""

    def __init__(self, message: str, *, bucket: int | None = None, expected: str | None = None,
                 got: str | None = None):
        super().__init__(message)
        self.bucket, self.expected, self.got = bucket, expected, got


class UnknownDigestAlg(DigestMismatch):
    """An announce whose ``digest_alg`` this process cannot compute (``alg``, the name
    announced): its bytes cannot be checked, so they are refused as bytes that do not match are."""

    def __init__(self, alg: str):
        super().__init__(f"digest_alg {alg!r} is not one this process knows ({', '.join(DIGEST_ALGS)}); "
                         f"the bytes cannot be checked")
        self.alg = alg


def _blake2b_128(data) -> str:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


def _blake3_128(data) -> str:
    return blake3.blake3(data).hexdigest(DIGEST_BYTES)


_HASHES: dict[str, Callable[..., str]] = {BLAKE2B_128: _blake2b_128, BLAKE3_128: _blake3_128}


def hasher(alg: str) -> Callable[..., str]:
    """The function from a buffer of bytes to its hex digest under ``alg`` (a
    ``weights_announce.digest_alg``); ``UnknownDigestAlg`` for a name this process does not know."""
    try:
        return _HASHES[alg]
    except KeyError:
        raise UnknownDigestAlg(alg) from None


def digest(data, alg: str = BLAKE2B_128) -> str:
    """Hex digest of ``data`` (any buffer of bytes), ``DIGEST_BYTES`` long, under ``alg``: the hash
    of ``weights_announce.digests``; 16 bytes leave no practical room for a second preimage.

    ``blake2b-128`` (protocol 1.6, the default) is in every Python and runs about 1.4 GB/s per core
    here; ``blake3-128`` (1.7, the ``blake3`` package) about 7 GB/s, so a broadcaster uses it when
    every member of the group can check it. Both release the GIL while they hash."""
    return hasher(alg)(data)


def _host_pieces(buffer: torch.Tensor, bucket_bytes: int) -> Iterator[memoryview]:
    """Each bucket of ``buffer`` (1-D uint8) as host memory, in order. A CPU buffer is read in
    place; a device buffer is copied one bucket at a time into one reused host tensor, so a digest
    costs one device-to-host pass over the buffer and ``bucket_bytes`` of host memory, never a
    host copy of the whole buffer."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"the buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} of shape "
                         f"{tuple(buffer.shape)}")
    staging = None
    if buffer.device.type != "cpu":
        staging = torch.empty(min(bucket_bytes, buffer.numel()), dtype=torch.uint8,
                              pin_memory=torch.cuda.is_available() and buffer.is_cuda)
    for start, stop in buckets(buffer.numel(), bucket_bytes):
        piece = buffer[start:stop]
        if staging is not None:
            piece = staging[: stop - start]
            piece.copy_(buffer[start:stop])  # synchronous: the bytes are on the host when it returns
        yield memoryview(piece.numpy())


HASH_THREADS_MAX = 8
"""Buckets of a host buffer hashed at once, at most (and never more than this process's CPUs)."""


def _hash_threads(buffer: torch.Tensor, bucket_bytes: int) -> int:
    """Threads to hash ``buffer`` with: one per CPU this process may run on, up to
    ``HASH_THREADS_MAX`` and the number of buckets; one for a device buffer, whose buckets
    share one host staging tensor and come one at a time."""
    if buffer.device.type != "cpu" or bucket_bytes < 1:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(HASH_THREADS_MAX, cpus, -(-buffer.numel() // bucket_bytes)))


def _digests(buffer: torch.Tensor, bucket_bytes: int, alg: str) -> Iterator[tuple[str, int]]:
    """``(digest, length)`` of each bucket of ``buffer`` under ``alg``, in order. The buckets of a
    host buffer are hashed on several threads at once (both hashes release the GIL): at about
    1.5 GB/s per core, one thread hashing a version with BLAKE2b takes as long as a gloo broadcast
    of it. Closing the iterator early (a mismatch) cancels the buckets not yet started."""
    fn = hasher(alg)
    threads = _hash_threads(buffer, bucket_bytes)
    if threads == 1:
        for piece in _host_pieces(buffer, bucket_bytes):
            yield fn(piece), len(piece)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="digest") as pool:
        jobs = [(pool.submit(fn, piece), len(piece)) for piece in _host_pieces(buffer, bucket_bytes)]
        try:
            for job, length in jobs:
                yield job.result(), length
        finally:
            for job, _ in jobs:
                job.cancel()


def bucket_digests(buffer: torch.Tensor, bucket_bytes: int, alg: str = BLAKE2B_128) -> list[str]:
    """The ``digest`` under ``alg`` of each of ``buckets(len(buffer), bucket_bytes)``, in order.

    Hashing runs on the host (per core about 1.4 GB/s with BLAKE2b, 7 GB/s with BLAKE3; both
    release the GIL), on up to ``HASH_THREADS_MAX`` threads (``_digests``), so a caller with a
    large buffer runs it off any loop that must keep serving; a device buffer also pays its copy
    to the host, bucket by bucket, on one thread (``_host_pieces``)."""
    return [d for d, _ in _digests(buffer, bucket_bytes, alg)]


def check_digests(buffer: torch.Tensor, bucket_bytes: int, digests: Sequence[str],
                  alg: str = BLAKE2B_128) -> None:
    """Raise ``DigestMismatch`` at the first bucket of ``buffer`` whose digest under ``alg`` is not
    the one ``digests`` gives, or when ``digests`` has not one digest per bucket; and
    ``UnknownDigestAlg`` (a ``DigestMismatch``) before hashing anything when ``alg`` is not one
    this process knows. Stops at the first bad bucket: a buffer that is refused need not be hashed
    to its end (buckets already being hashed on other threads finish). Costs as ``bucket_digests``."""
    hasher(alg)
    count = -(-buffer.numel() // bucket_bytes) if bucket_bytes >= 1 else 0
    if len(digests) != count:
        raise DigestMismatch(f"{len(digests)} digests announced for the {count} buckets of {bucket_bytes} bytes in "
                             f"a {buffer.numel()}-byte buffer")
    got_all = _digests(buffer, bucket_bytes, alg)
    try:
        for i, (got, length) in enumerate(got_all):
            if got != digests[i]:
                start = i * bucket_bytes
                raise DigestMismatch(f"bucket {i} (bytes {start}:{start + length}) has {alg} digest {got}, "
                                     f"announced {digests[i]}", bucket=i, expected=digests[i], got=got)
    finally:
        got_all.close()  # a refused buffer need not be hashed to its end

