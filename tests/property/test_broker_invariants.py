"""The real broker core against the plain model: all seven invariants after every step.

One state machine per mode, so each mode gets the full budget of the active hypothesis profile
(tests/conftest.py; CI: 400 examples of up to 50 steps each). B, n, r, η, the over-bound policy
and the response budget are drawn anew for every example.
"""

from april_async.broker.core import BrokerCore
from tests.property.broker_model import make_machine

TestSyncMode = make_machine(BrokerCore, modes=("sync",)).TestCase
TestAprilMode = make_machine(BrokerCore, modes=("april",)).TestCase
TestAsyncMode = make_machine(BrokerCore, modes=("async",)).TestCase
