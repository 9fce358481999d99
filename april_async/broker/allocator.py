"""The malloc a broker process runs on, named as its start log and ``tools/simulate.py`` print it.

The broker's slowest calls at 1,000 generators depended on the allocator (docs/benchmarks.md,
"Scale"): ``april up`` preloads jemalloc where ``libjemalloc.so.2`` is installed
(``run.broker_allocator``, ``up/plan.py``), else the process runs on the C library's malloc
with whatever ``GLIBC_TUNABLES`` the user set. Only reads what the process was started with.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")  # allocators known by the name of their library


def allocator_in_use() -> str:
    """One line: the allocator mapped into this process and the settings it runs with."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    name = next((n for n in PRELOADED if f"lib{n}" in maps), None)
    if name == "jemalloc":
        conf = os.environ.get("MALLOC_CONF", "")
        return (f"jemalloc, MALLOC_CONF={conf!r}" if conf else "jemalloc") + (
            "" if "background_thread:true" in conf else " (without background_thread:true, freed pages are purged "
                                                        "inside calls: set MALLOC_CONF=background_thread:true)")
    if name is not None:
        return name
    tunables = ":".join(t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc."))
    return f"glibc {_glibc_version()} malloc, " + (f"GLIBC_TUNABLES={tunables!r}" if tunables else "default settings")


def _glibc_version() -> str:
    try:
        fn = ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        return "(version unknown)"
    fn.restype = ctypes.c_char_p
    return fn().decode()
