"""``runtime.free_port``: ports for children that have not bound them yet, never the same one twice
from one process, from the range ``APRIL_FREE_PORTS`` names; a malformed range is refused by name."""

import os
import socket

import pytest

from april_async import runtime
from april_async.testing.procs import worker_ports


@pytest.fixture
def ports(monkeypatch):
    """A range of 40 ports of this worker's own, with nothing handed out from it yet."""
    worker = runtime.free_port_range()
    monkeypatch.setenv(runtime.PORTS_ENV, f"{worker.stop - 40}-{worker.stop - 1}")
    monkeypatch.setattr(runtime, "_handed_out", set())
    return range(worker.stop - 40, worker.stop)


def test_one_process_never_hands_out_a_port_twice_while_its_children_have_not_bound_them(ports):
    # 20 picks of 40 ports: picked at random and independently, two would be equal in >99% of runs.
    picked = [runtime.free_port() for _ in range(20)]
    assert len(set(picked)) == len(picked) and set(picked) <= set(ports)


def test_a_range_half_handed_out_starts_over_so_a_long_lived_process_does_not_run_out(ports):
    picked = [runtime.free_port() for _ in range(len(ports) * 3)]  # three times the range: no error
    assert set(picked) <= set(ports) and len(picked) > len(set(picked))


def test_a_port_something_listens_on_is_not_handed_out(ports):
    listeners = []  # on every port of the range but one (a port this worker's children hold is taken too)
    try:
        for port in ports:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            listeners.append(s)
        last = listeners.pop()
        last_port = last.getsockname()[1]
        last.close()
        assert runtime.free_port() == last_port
        assert runtime._handed_out == {last_port}
        with pytest.raises(RuntimeError, match=f"no free TCP port in {ports.start}-{ports.stop - 1}"):
            runtime.free_port()  # the one free port is handed out, the rest are taken
    finally:
        for s in listeners:
            s.close()


@pytest.mark.parametrize("spec, problem", [
    ("20000", "is not LO-HI"), ("a-b", "is not LO-HI"), ("20000-20010-20020", "is not LO-HI"),
    ("80-90", "want 1024 <= LO <= HI <= 65535"), ("30000-20000", "want 1024 <= LO <= HI"),
    ("60000-70000", "HI <= 65535"),
])
def test_a_malformed_range_is_refused_naming_the_variable(monkeypatch, spec, problem):
    monkeypatch.setenv(runtime.PORTS_ENV, spec)
    with pytest.raises(ValueError, match=f"APRIL_FREE_PORTS='{spec}'.*{problem}"):
        runtime.free_port()


def test_test_workers_pick_from_slices_that_do_not_overlap():
    slices = [worker_ports(range(20000, 32000), f"gw{i}", 5) for i in range(5)]
    assert [(r.start, r.stop) for r in slices] == [(20000 + 2400 * i, 22400 + 2400 * i) for i in range(5)]
    with pytest.raises(ValueError, match="worker 'gw3' of 3: no slice of ports 20000-31999"):
        worker_ports(range(20000, 32000), "gw3", 3)
    if "PYTEST_XDIST_WORKER" in os.environ:  # this worker's, set by tests/conftest.py
        worker, count = os.environ["PYTEST_XDIST_WORKER"], int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
        assert runtime.free_port_range() == worker_ports(runtime.FREE_PORTS, worker, count)
