"""The ``april`` command's start-up order: an actor's stop flag comes before anything heavy."""

import json
import subprocess
import sys

import pytest

PROBE = """
import json, signal, sys
real = signal.signal
def probe(signum, handler):
    if signum == signal.SIGTERM:  # the stop flag is being installed: what has been imported by now?
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "msgspec", "numpy", "zmq", "torch")
                       or m.startswith(("april_async.sim", "april_async.config")))
        print(json.dumps(heavy))
        sys.exit(0)
    return real(signum, handler)
signal.signal = probe
from april_async.cli import main
main(sys.argv[1:])
print("null")
"""


@pytest.mark.parametrize("actor", ["broker", "generator", "scorer", "learner", "broadcaster"])
def test_an_actor_can_be_stopped_cleanly_before_it_imports_anything_heavy(actor):
    """A SIGTERM in the first moments of an actor's life (a run stopped as it starts) must find the
    stop flag installed, so that the actor exits 0 rather than die of the signal: nothing heavy
    (pydantic, the config models, numpy, ZeroMQ, torch) may be imported before it."""
    out = subprocess.run([sys.executable, "-c", PROBE, actor, "--set", "link.broker=\"tcp://127.0.0.1:1\""],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [], out.stdout
