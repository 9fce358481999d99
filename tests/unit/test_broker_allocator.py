"""``allocator_in_use`` names the malloc a process runs on and its settings, as the broker's start
log and ``tools/simulate.py`` print it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_async.up.plan import JEMALLOC_CONF, JEMALLOC_PATHS

SHOW = "from april_async.broker.allocator import allocator_in_use; print(allocator_in_use())"


def _shown(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**base, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.strip()


def test_glibc_is_named_with_its_version_and_the_malloc_tunables_set():
    assert _shown().startswith("glibc ") and _shown().endswith("malloc, default settings")
    shown = _shown(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576:glibc.rtld.nns=2")
    assert shown.endswith("GLIBC_TUNABLES='glibc.malloc.trim_threshold=1048576'")  # malloc's only


def test_jemalloc_is_named_with_its_conf_and_without_the_background_thread_a_warning():
    lib = next((p for p in JEMALLOC_PATHS if Path(p).is_file()), None)
    if lib is None:
        pytest.skip("no libjemalloc.so.2 here (apt install libjemalloc2)")
    assert _shown(LD_PRELOAD=lib, MALLOC_CONF=JEMALLOC_CONF) == f"jemalloc, MALLOC_CONF={JEMALLOC_CONF!r}"
    assert "set MALLOC_CONF=background_thread:true" in _shown(LD_PRELOAD=lib)
