"""The protocol version: the one place it is stated in code.

It is kept apart from the package version. ``MAJOR.MINOR``: a peer MUST refuse a frame whose
major differs from its own; a minor bump only adds optional fields or new message types.
``proto/SPEC.md`` and every schema in ``proto/schemas/`` state the same value (tested).
"""

PROTO_VERSION = "1.10"
PROTO_MAJOR = int(PROTO_VERSION.split(".")[0])


def parse(proto_version: str) -> tuple[int, int]:
    """``"MAJOR.MINOR"`` as numbers, for "since" checks against a peer's version (a part that is
    not a number, or missing, counts as 0: such a peer has none of the later additions)."""
    major, _, minor = proto_version.partition(".")
    return (int(major) if major.isdigit() else 0, int(minor) if minor.isdigit() else 0)

