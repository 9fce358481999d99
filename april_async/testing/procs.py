"""Child processes for tests: ``april_async.runtime``'s helpers (free ports, children that die with
their parent), with the checkout as the children's directory."""

from __future__ import annotations

import functools
from pathlib import Path

from april_async import runtime
from april_async.runtime import FREE_PORTS, ChildFailed, free_port, stop

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (children run from it, so that ``tools/`` and ``python -m`` find the same files)."""

spawn = functools.partial(runtime.spawn, cwd=ROOT)
"""``runtime.spawn`` from the checkout."""

__all__ = ["FREE_PORTS", "ROOT", "ChildFailed", "free_port", "spawn", "stop"]
