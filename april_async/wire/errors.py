"""Typed errors of the wire: every bad frame becomes one of these, never a bare crash.

Each error has a stable ``code`` that travels in an ``error`` message back to the peer, and,
where a field is at fault, its path (``$.body.tokens``) in ``field``.
"""

from __future__ import annotations


class WireError(Exception):
    """A frame that cannot be accepted. ``code`` is the value sent in ``Error.code``."""

    code = "malformed"

    def __init__(self, message: str, *, field: str | None = None, msg_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.msg_id = msg_id  # the offending message's id, when the envelope could be read

    def __str__(self) -> str:
        where = f" (at {self.field})" if self.field else ""
        return f"{self.code}: {self.message}{where}"


class MalformedFrame(WireError):
    """Not MessagePack, wrong shape, a missing field or a value out of range."""

    code = "malformed"


class UnknownMessageType(WireError):
    """``msg_type`` names no message of this protocol version."""

    code = "unknown_type"


class ProtocolVersionMismatch(WireError):
    """``proto_version`` has another major version than ours."""

    code = "version_mismatch"


class FrameTooLarge(WireError):
    """A frame, or the message as a whole, is over the configured size limit."""

    code = "too_large"


class BulkFrameError(WireError):
    """A reference to a bulk frame is out of range, of a wrong dtype, or of a wrong length."""

    code = "bad_bulk"
