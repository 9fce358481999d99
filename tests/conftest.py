"""Hypothesis profiles: ``dev`` (default, quick) and ``ci`` (what .ci/run uses).

Pick one with HYPOTHESIS_PROFILE=ci. The broker state machine runs up to
``max_examples`` × ``stateful_step_count`` steps per test (CI: 400 × 50 per mode).

One torch thread per process, in the test process and in every process it starts (they inherit
``OMP_NUM_THREADS``), as ``april up`` gives each actor (``run.threads = 1``): the suite runs three
workers and their actors on two cores, where a second intra-op thread per process only contends.
(A 0.1M-parameter decoder's 400 greedy steps took 5.4 s of CPU with two threads, 0.36 s with one.)
A test or tool that wants more threads sets them itself (``torch.set_num_threads``).
"""

import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A suite started in the background by a non-interactive shell (``bash tools/test.sh &``, a CI step
# that does so) inherits SIGINT ignored, and so would every process it starts. bash cannot trap a
# signal that was ignored when it started, so ``launch/cluster.sh`` would never see the Ctrl-C its
# tests send: they would time out, and the three-namespace run they leave going would use a core
# for two minutes. Python's own handler here means each child starts with the default instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from hypothesis import HealthCheck, settings

from april_async.runtime import PORTS_ENV, free_port_range
from april_async.testing.procs import worker_ports

# Each pytest-xdist worker picks ports for its children from a slice of its own (``free_port``): two
# workers could otherwise pick the same port for children that have not bound it yet.
if "PYTEST_XDIST_WORKER" in os.environ:
    _ports = worker_ports(free_port_range(), os.environ["PYTEST_XDIST_WORKER"],
                          int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ[PORTS_ENV] = f"{_ports.start}-{_ports.stop - 1}"

COMMON = dict(
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile("ci", max_examples=400, print_blob=True, **COMMON)
settings.register_profile("dev", max_examples=60, **COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

POOLED = tuple(f"tests/integration/{name}.py::" for name in
               ("test_learner_ranks", "test_sglang_engine", "test_sglang_standin", "test_roles"))
"""Modules whose tests share processes started once per module (two learner ranks, stand-in
servers, a broker and a broadcaster)."""


def pytest_collection_modifyitems(config, items):
    """The pooled modules run first, the rest in file order. ``tools/test.sh``'s workers each take a
    third of the tests in this order and steal from the end of another's queue when theirs runs
    out; a pooled module near a queue's end was split, and each worker that took part of it
    started the pool again (test_learner_ranks.py: two learner ranks, ~10 s of CPU, for one test)."""
    items.sort(key=lambda item: not item.nodeid.startswith(POOLED))  # stable: file order otherwise
