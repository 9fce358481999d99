"""Frames <-> typed messages. No sockets here (see ``april_async.transport``).

A message is a list of frames: frame 0 is the MessagePack envelope with the body inline; each
bulk array of the body is one more frame of raw little-endian bytes, referenced from the body as
``{"frame": i, "dtype": "<i4", "len": n}``. Decoding is bound to the message type named in the
envelope, so a bad frame fails here with a typed ``WireError`` naming the field, and the bulk
arrays come back as read-only ``numpy`` views of the received frames (no copy).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np

from april_async.wire.errors import (
    BulkFrameError,
    FrameTooLarge,
    MalformedFrame,
    ProtocolVersionMismatch,
    UnknownMessageType,
)
from april_async.wire.messages import MESSAGE_TYPES, Body, Envelope
from april_async.wire.version import PROTO_MAJOR, PROTO_VERSION

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default limit on the bytes of all frames of one message together."""

BULK_DTYPES = frozenset({"<i4", "<f4", "|u1"})

_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`")

Frame = bytes | memoryview


class BulkRef(msgspec.Struct, forbid_unknown_fields=True):
    """The header's stand-in for one bulk array: which frame, its dtype and element count."""

    frame: int
    dtype: str
    len: int


class _WireEnvelope(Envelope, kw_only=True):
    body: msgspec.Raw = msgspec.Raw(b"\xc0")  # nil


class _EnvelopeProbe(msgspec.Struct):
    """The fields read from an envelope that failed to decode: its version comes first."""

    proto_version: Any = None
    msg_id: Any = None
    sender: Any = None


class _BadBulk(ValueError):
    """A bulk reference that cannot be resolved; ``decode`` reports it as ``BulkFrameError``."""


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded message: the envelope's fields and the typed body."""

    msg_id: str
    msg_type: str
    sender: str
    seq: int
    sent_at: float
    body: Body
    parent_id: str | None = None
    proto_version: str = PROTO_VERSION


def new_msg_id() -> str:
    """64 random bits as 16 hex characters."""
    return os.urandom(8).hex()


# Bulk frames of the message being encoded or decoded on this thread.
_local = threading.local()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        frames: list[Frame] = _local.out_frames
        arr = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<"))
        frames.append(memoryview(arr).cast("B"))
        return {"frame": len(frames) - 1, "dtype": arr.dtype.str, "len": int(arr.shape[0])}
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is not np.ndarray:
        raise NotImplementedError(f"no decoder for {typ}")
    # The common, well-formed case without the cost of msgspec.convert; anything else goes
    # through it for an exact error.
    if type(obj) is dict and len(obj) == 3 and type(obj.get("frame")) is int and type(obj.get("len")) is int \
            and type(obj.get("dtype")) is str:
        ref = _FastRef(obj["frame"], obj["dtype"], obj["len"])
    else:
        ref = _convert_ref(obj)
    return _resolve(ref)


class _FastRef(NamedTuple):
    frame: int
    dtype: str
    len: int


_DTYPES = {name: np.dtype(name) for name in BULK_DTYPES}


def _convert_ref(obj: Any):
    try:
        return msgspec.convert(obj, BulkRef)
    except msgspec.ValidationError as e:
        text, _, inner = str(e).partition(" - at `")  # inner: the key of the reference, "$.frame`"
        where = f" (in {inner.rstrip('`')})" if inner else ""
        raise _BadBulk(f"bad bulk reference: {text}{where}") from None


def _resolve(ref) -> np.ndarray:
    frames: Sequence[Frame] = _local.in_frames
    if not 1 <= ref.frame < len(frames):
        raise _BadBulk(f"bulk frame {ref.frame} does not exist ({len(frames)} frames)")
    if ref.frame in _local.used:
        raise _BadBulk(f"bulk frame {ref.frame} is referenced twice")
    dtype = _DTYPES.get(ref.dtype)
    if dtype is None:
        raise _BadBulk(f"bulk dtype {ref.dtype!r} is not one of {sorted(BULK_DTYPES)}")
    buf = frames[ref.frame]
    nbytes = len(buf) if type(buf) is bytes else memoryview(buf).nbytes
    if nbytes != ref.len * dtype.itemsize:
        raise _BadBulk(f"bulk frame {ref.frame} has {nbytes} bytes, expected {ref.len} x {dtype.itemsize}")
    _local.used.add(ref.frame)
    arr = np.frombuffer(buf, dtype=dtype)
    if arr.flags.writeable:  # a writable frame (bytearray, the sender's own array) stays untouched
        arr.flags.writeable = False
    return arr


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_envelope_decoder = msgspec.msgpack.Decoder(_WireEnvelope)
_probe_decoder = msgspec.msgpack.Decoder(_EnvelopeProbe)
_body_decoders = {name: msgspec.msgpack.Decoder(cls, dec_hook=_dec_hook) for name, cls in MESSAGE_TYPES.items()}


def encode(
    body: Body,
    *,
    sender: str,
    seq: int,
    parent_id: str | None = None,
    msg_id: str | None = None,
    sent_at: float | None = None,
) -> list[Frame]:
    """Frames of one message: the envelope, then one frame per bulk array (zero-copy views)."""
    if MESSAGE_TYPES.get(getattr(type(body), "msg_type", None)) is not type(body):
        raise TypeError(f"{type(body).__name__} is not a message of this protocol")
    envelope = Envelope(
        msg_id=msg_id or new_msg_id(),
        msg_type=body.msg_type,
        sender=sender,
        seq=seq,
        proto_version=PROTO_VERSION,
        sent_at=time.time() if sent_at is None else sent_at,
        parent_id=parent_id,
        body=body,
    )
    frames: list[Frame] = [b""]
    _local.out_frames = frames
    try:
        frames[0] = _encoder.encode(envelope)
    finally:
        _local.out_frames = None
    return frames


def decode(frames: Sequence[Frame], *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Typed message from received frames, or a ``WireError`` saying what is wrong and where."""
    if not frames:
        raise MalformedFrame("a message needs at least one frame")
    total = sum(memoryview(f).nbytes for f in frames)
    if total > max_message_bytes:
        raise FrameTooLarge(f"message of {total} bytes is over the limit of {max_message_bytes}")
    try:
        env = _envelope_decoder.decode(frames[0])
    except msgspec.ValidationError as e:
        # Another major version may shape its envelope differently: say so before "malformed".
        probe = _probe_envelope(frames[0])
        msg_id = probe.msg_id if isinstance(probe.msg_id, str) else None
        if isinstance(probe.proto_version, str):
            _check_major(probe.proto_version, probe.sender, msg_id)
        raise MalformedFrame(f"bad envelope: {e}", field=_path_of(e), msg_id=msg_id) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise MalformedFrame(f"frame 0 is not a MessagePack envelope: {e}") from None
    _check_major(env.proto_version, env.sender, env.msg_id)
    decoder = _body_decoders.get(env.msg_type)
    if decoder is None:
        raise UnknownMessageType(
            f"unknown msg_type {env.msg_type!r}", field="$.msg_type", msg_id=env.msg_id
        )
    _local.in_frames = frames
    _local.used = set()
    try:
        body = decoder.decode(env.body)
        if len(_local.used) != len(frames) - 1:
            unused = sorted(set(range(1, len(frames))) - _local.used)
            raise BulkFrameError(f"frames {unused} are referenced by no field", msg_id=env.msg_id)
    except msgspec.ValidationError as e:
        cls = BulkFrameError if isinstance(e.__cause__, _BadBulk) else MalformedFrame
        raise cls(f"bad {env.msg_type} body: {e}", field=_body_path(e), msg_id=env.msg_id) from None
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:
        # __post_init__ checks (lengths, spans, ranges) raise ValueError/TypeError; msgspec raises
        # RecursionError on values nested too deep (in a ``meta`` map, say).
        raise MalformedFrame(f"bad {env.msg_type} body: {e}", field="$.body", msg_id=env.msg_id) from None
    finally:
        _local.in_frames = None
    return Message(
        msg_id=env.msg_id,
        msg_type=env.msg_type,
        sender=env.sender,
        seq=env.seq,
        sent_at=env.sent_at,
        body=body,
        parent_id=env.parent_id,
        proto_version=env.proto_version,
    )


def _check_major(proto_version: str, sender: Any, msg_id: str | None) -> None:
    if proto_version.split(".", 1)[0] != str(PROTO_MAJOR):
        raise ProtocolVersionMismatch(
            f"protocol {proto_version!r} from {sender!r}, this peer speaks {PROTO_VERSION}",
            field="$.proto_version",
            msg_id=msg_id,
        )


def _probe_envelope(frame: Frame) -> _EnvelopeProbe:
    try:
        return _probe_decoder.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return _EnvelopeProbe()


def _path_of(err: msgspec.ValidationError) -> str | None:
    text = str(err)
    path = text.rsplit(" - at `", 1)[1].rstrip("`") if " - at `" in text else None
    if path is not None and "` in `" in path:  # a bad map key: "key` in `$.meta" -> "$.meta"
        path = path.rsplit("` in `", 1)[1]
    missing = _MISSING_FIELD.match(text)  # msgspec names a missing field but leaves it out of the path
    return f"{path or '$'}.{missing.group(1)}" if missing else path


def _body_path(err: msgspec.ValidationError) -> str:
    path = _path_of(err)
    return "$.body" + path[1:] if path else "$.body"
