"""The state machine has teeth: for each invariant, a core with one planted bug is caught.

Each broken core below differs from the real one in a single place. The same state machine
that passes against the real core must fail against each of these, and name the invariant
that the planted bug breaks (not merely disagree with the model).
"""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from april_async.broker.core import BrokerCore, FifoSet, Place
from april_async.testing.strategies import planted_search
from tests.property.broker_model import InvariantViolation, make_machine


class LosesPartialTokens(BrokerCore):
    """1 conservation: an aborted or reclaimed lease comes back as a partial without its tokens."""

    def _move(self, s, place):
        if place is Place.PARTIAL and s.place is Place.LEASED:
            s.token_bytes, s.logprob_bytes, s.span_runs = b"", b"", b""
        super()._move(s, place)


class DeliversTwice(BrokerCore):
    """2 exactly-once: a delivered group stays on the ledger, in the ready queue."""

    def _move(self, s, place):
        if place is not Place.DELIVERED:
            super()._move(s, place)

    def _forget(self, g):
        if g.state != "delivered":
            super()._forget(g)


class IgnoresInflightBound(BrokerCore):
    """3 bounded in-flight: any group may start, whatever ceil(r·B) says."""

    def _group_admissible(self, gid):
        return True


class IgnoresStaleness(BrokerCore):
    """4 staleness: η is never enforced."""

    def is_stale(self, s, version=None):
        return False


class FreshBeforePartials(BrokerCore):
    """5 no starvation: fresh prompts are leased before recycled partials."""

    def _lease_queue(self):
        return self._fresh or self._recycle


class DeliversUnscoredGroups(BrokerCore):
    """6 group integrity: groups whose generation is done go out before every sample is scored."""

    def pull_batch(self, now, max_samples=None):
        ready, self._ready = self._ready, FifoSet(list(self._done))
        try:
            return super().pull_batch(now, max_samples)
        finally:
            self._ready = FifoSet([g for g in ready if g in self.groups])

    def _deliver(self, g, samples):
        for s in samples:  # one at a time, as the real core's bulk move refuses a group not all scored
            self._move(s, Place.DELIVERED)


class ForgetsPartialsOnRestart(BrokerCore):
    """7 durability: a restart from the snapshot loses the tokens of recycled partials."""

    @classmethod
    def from_bytes(cls, data, config=None):
        core = super().from_bytes(data, config)
        for s in core.samples.values():
            if s.place is Place.PARTIAL:
                s.token_bytes, s.logprob_bytes, s.span_runs = b"", b"", b""
        return core


class MiscountsObservations(BrokerCore):
    """1 conservation: a trajectory's observation is held but its tokens are not counted."""

    def observed(self, sample_id, lease_id, tokens, now):
        before = self.counters.tokens_observed
        try:
            return super().observed(sample_id, lease_id, tokens, now)
        finally:
            self.counters.tokens_observed = before


PLANTED = [
    (LosesPartialTokens, 1),
    (DeliversTwice, 2),
    (IgnoresInflightBound, 3),
    (IgnoresStaleness, 4),
    (FreshBeforePartials, 5),
    (DeliversUnscoredGroups, 6),
    (ForgetsPartialsOnRestart, 7),
]

SEARCH = planted_search(max_examples=2000, steps=50)


@pytest.mark.parametrize(("broken", "invariant"), PLANTED, ids=[f"{i}-{c.__name__}" for c, i in PLANTED])
def test_planted_violation_is_found(broken, invariant):
    with pytest.raises(InvariantViolation) as found:
        run_state_machine_as_test(make_machine(broken, trajectories=False), settings=SEARCH)
    assert found.value.invariant == invariant, str(found.value)


def test_real_core_passes_the_same_search():
    """The search used above finds nothing in the real core (so the failures are the bugs')."""
    run_state_machine_as_test(make_machine(BrokerCore), settings=settings(SEARCH, max_examples=300))


def test_a_planted_trajectory_bug_is_found_in_the_trajectory_space():
    """The observation rule reaches the ledger: a core that holds an observation's tokens without
    counting them breaks conservation, and the search over trajectories finds it."""
    with pytest.raises(InvariantViolation) as found:
        run_state_machine_as_test(make_machine(MiscountsObservations, trajectories="always"), settings=SEARCH)
    assert found.value.invariant == 1, str(found.value)
