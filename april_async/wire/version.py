"""The protocol version: the one place it is stated in code.

It is kept apart from the package version. ``MAJOR.MINOR``: a peer MUST refuse a frame whose
major differs from its own; a minor bump only adds optional fields or new message types.
``proto/SPEC.md`` and every schema in ``proto/schemas/`` state the same value (tested).
"""

PROTO_VERSION = "1.6"
PROTO_MAJOR = int(PROTO_VERSION.split(".")[0])
