"""Fixtures more than one integration test file uses."""

import pytest

from april_async.testing.weights import Weights


@pytest.fixture
def weights(tmp_path):
    """A broadcaster test cluster (``april_async.testing.weights``); every process must have stopped
    clean (or been killed by the test) at the end."""
    w = Weights(tmp_path)
    yield w
    codes = w.close()
    assert all(code in (0, -9) for code in codes.values()), f"exit codes {codes}\n{w.cluster.dump_logs()}"
