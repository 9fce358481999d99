"""Network partitions of a real run across three hosts (``launch/cluster.sh`` in network
namespaces, ``testing.partition.ClusterRun``): the head (broker, broadcaster, learner, scorer) and
one generator on each of two other hosts.

Each case cuts links in the middle of a run, restores them, and checks: the cut generators hold the
newest version again within ``CATCH_UP_S`` of the link's return; the learner's rate afterwards is
within ``RATE_TOLERANCE`` of its rate before; the run reaches its step target; and at the end the
broker's ledger balances, no sample is in two batches, and nothing was trained past η (or on tokens
newer than the learner's version). Each prints its figures, recovery time included.

Issue 29: after a 25 s cut of one generator host the generator never got a session again (its two
peers' back-offs starved each other) and every other round waited for it; the learner went from
15 steps in 29 s to one a minute.

Marked ``partition``: left out of the default run, run by CI after it, one at a time
(``.ci/run``; by hand ``pytest -m partition``); each takes about 70 s. The rates are taken
over 20 s windows: over 6 s ones a run with no cut moved by a third on a loaded machine.
"""

from __future__ import annotations

import json

import pytest

from april_async.testing.netns import unavailable
from april_async.testing.partition import ClusterRun, cut_and_measure

pytestmark = [pytest.mark.partition, pytest.mark.slow]

WHY_NOT = unavailable()
CATCH_UP_S = 30.0
RATE_TOLERANCE = 0.25
"""How far the learner's rate after a cut may fall below its rate before: the same case with no
regression gave 0.78 to 0.92 of it on this 2-core machine (2026-11-26, four runs); the fault it
guards against made the rate 15 times slower for good."""
MORE_STEPS = 20  # the step target: this many steps after the run is measured


def finish(run: ClusterRun, fig: dict, cut_hosts: list[str], label: str) -> None:
    print(f"{label}: " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in fig.items()}))
    assert fig["recovery_s"] is not None, f"{cut_hosts} did not hold the newest version within {CATCH_UP_S} s\n" \
                                          f"{run.status()}\n{run.tail()}"
    print(f"{label}: recovered {fig['recovery_s']:.1f} s after the link returned")
    target = fig["step_at_end"] + MORE_STEPS
    run.wait(f"learner step {target}", lambda: run.step() >= target, 120)
    code = run.stop()
    assert code == 130, run.tail()
    summaries = {p.name: json.loads(p.read_text()) for p in sorted(run.run.glob("summary-n*.json"))}
    print(f"{label}: exit codes " + json.dumps({k: v.get("exit_codes") for k, v in summaries.items()}))
    restarted = {k: v.get("restarts") for k, v in summaries.items() if any((v.get("restarts") or {}).values())}
    assert not restarted, f"a partition must not take an actor down: {restarted}"
    audit = run.audit()
    assert audit["balanced"], audit
    assert audit["duplicates"] == 0 and audit["over_eta"] == 0 and audit["from_future"] == 0, audit
    assert audit["trained"] > 0
    # Last, so that a machine busy with other work (the rate moves by a third between 6 s windows
    # of a run with no cut on a loaded 2-core machine) does not hide the checks above.
    assert fig["after_spm"] >= (1 - RATE_TOLERANCE) * fig["before_spm"], \
        f"the learner's rate after the cut is not within {RATE_TOLERANCE:.0%} of before: {fig}"


needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces: {WHY_NOT}")


@needs_netns
def test_one_generator_host_cut_for_25_s(tmp_path):
    with ClusterRun(tmp_path) as run:
        fig = cut_and_measure(run, cut=lambda: run.hosts.cut(2), restore=lambda: run.hosts.restore(2), cut_s=25.0,
                              watch=["n2-gen-0"], catch_up_s=CATCH_UP_S)
        finish(run, fig, ["n2-gen-0"], "one host, 25 s")


@needs_netns
def test_every_generator_host_cut_at_once(tmp_path):
    def cut():
        run.hosts.cut(1)
        run.hosts.cut(2)

    def restore():
        run.hosts.restore(1)
        run.hosts.restore(2)

    with ClusterRun(tmp_path) as run:
        fig = cut_and_measure(run, cut=cut, restore=restore, cut_s=15.0, watch=run.generators, catch_up_s=CATCH_UP_S)
        finish(run, fig, run.generators, "every generator host, 15 s")


@needs_netns
def test_a_generator_host_cut_longer_than_its_lease_time(tmp_path):
    """Silent loss both ways (the link stays up: nothing tells either side) for longer than the
    broker's lease timeout: the generator's leases were reclaimed, and it gets fresh ones."""
    lease_s = 8.0
    with ClusterRun(tmp_path, rollout=f"lease_timeout_s = {lease_s}") as run:
        fig = cut_and_measure(run, cut=lambda: run.hosts.drop(1), restore=lambda: run.hosts.undrop(1),
                              cut_s=lease_s + 7.0, watch=["n1-gen-0"], catch_up_s=CATCH_UP_S)
        finish(run, fig, ["n1-gen-0"], "one host past its lease, silent loss")


@needs_netns
def test_the_heads_link_while_batches_are_delivered(tmp_path):
    """The head loses every packet both ways for 10 s while the learner takes batches: every
    generator loses the broker and the broadcaster at once, the head's own actors keep talking."""
    with ClusterRun(tmp_path) as run:
        fig = cut_and_measure(run, cut=lambda: run.hosts.drop(0), restore=lambda: run.hosts.undrop(0), cut_s=10.0,
                              watch=run.generators, catch_up_s=CATCH_UP_S)
        finish(run, fig, run.generators, "the head, 10 s")
