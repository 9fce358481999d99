"""The wire: typed messages, the frame codec and its errors (no sockets)."""

from april_async.wire.codec import Message, decode, encode
from april_async.wire.errors import WireError
from april_async.wire.version import PROTO_VERSION

__all__ = ["Message", "decode", "encode", "WireError", "PROTO_VERSION"]
