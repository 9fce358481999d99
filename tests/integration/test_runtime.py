"""The actor runtime end to end: a real broker, real generators (scripted test engine), a real
scorer, and the test process as the learner, all separate processes on loopback."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from april_async.broker.config import RolloutConfig
from april_async.testing.cluster import Cluster, check_batch_tokens

B, N = 2, 2
ROLLOUT = {"batch_groups": B, "group_size": N, "over_provision": 2.0, "staleness_bound": 2}
LENGTHS = [6, 6, 10, 14, 40]  # a long tail, cycled by sample id


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    codes = c.stop_all()  # SIGTERM: every actor must shut down cleanly (exit 0)
    assert all(code in (0, -9) for code in codes.values()), f"exit codes {codes}\n{c.dump_logs()}"


def run_learner(cluster: Cluster, batches: int, *, timeout_s: float = 60.0, publish: bool = True):
    """Pull ``batches`` batches as a learner would, publishing a new version after each."""
    learner = cluster.learner()
    got = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < batches:
            assert time.monotonic() < deadline, f"only {len(got)} of {batches} batches\n{cluster.dump_logs()}"
            cluster.assert_alive()
            batch = learner.next_batch(1.0)
            if batch is None:
                continue
            got.append(batch)
            if publish:
                learner.publish(batch.policy_version + 1)
    finally:
        learner.close()
    return got


@pytest.mark.parametrize("mode", ["sync", "april", "async"])
def test_each_mode_delivers_whole_checked_batches(cluster, mode):
    rollout = dict(ROLLOUT, mode=mode)
    if mode == "sync":
        rollout.update(over_provision=1.0, staleness_bound=0)
    cluster.broker(rollout)
    cluster.generator("gen-0", slots=3, lengths=LENGTHS)
    cluster.generator("gen-1", slots=3, lengths=LENGTHS)
    cluster.scorer()
    batches = run_learner(cluster, 4)
    ids = []
    for b in batches:
        assert len(b.groups) == B and all(len(g.samples) == N for g in b.groups)
        assert all(len({s.sample_id // N for s in g.samples}) == 1 for g in b.groups)  # whole groups
        for g in b.groups:
            for s in g.samples:
                assert s.reward == (1.0 if s.response_len % 2 == 0 else 0.0)  # the parity reward
        ids += check_batch_tokens(b)
    assert len(ids) == len(set(ids)) == 4 * B * N
    if mode == "sync":
        assert all(s.versions[0].version == b.policy_version for b in batches for g in b.groups for s in g.samples)


def ledger(journal_dir: Path, rollout: dict):
    from april_async.broker.journal import Journal
    from april_async.broker.service import replay

    journal = Journal(journal_dir, durability="none")
    core, _, _ = replay(journal, RolloutConfig(**rollout))
    journal.close()
    return core


@pytest.mark.slow
def test_broker_kill_9_at_random_moments_loses_nothing(cluster, tmp_path):
    """kill -9 the broker 20 times mid-run; each restart replays its journal."""
    journal = tmp_path / "journal"
    rollout = dict(ROLLOUT, mode="april")
    extra = {"snapshot_every_records": 200}
    cluster.broker(rollout, journal=journal, extra=extra)
    cluster.generator("gen-0", slots=3, lengths=LENGTHS, step_s_fixed=0.002)
    cluster.generator("gen-1", slots=3, lengths=LENGTHS, step_s_fixed=0.002)
    cluster.scorer()
    learner = cluster.learner()
    rng = random.Random(7)
    received: list[int] = []
    kills = 0
    try:
        while kills < 20:
            until = time.monotonic() + rng.uniform(0.2, 0.8)
            while time.monotonic() < until:
                batch = learner.next_batch(0.05)
                if batch is not None:
                    received += check_batch_tokens(batch)
                    learner.publish(batch.policy_version + 1)
            cluster.kill("broker")
            kills += 1
            cluster.broker(rollout, journal=journal, extra=extra)
        deadline = time.monotonic() + 30
        after_last_restart = 0
        while (len(received) < 6 * B * N or not after_last_restart) and time.monotonic() < deadline:
            batch = learner.next_batch(0.5)
            if batch is not None:
                received += check_batch_tokens(batch)
                after_last_restart += 1
                learner.publish(batch.policy_version + 1)
        assert after_last_restart, f"no batch after the last restart\n{cluster.dump_logs()}"
    finally:
        learner.close()
    cluster.stop_all()
    assert len(received) == len(set(received)), "a sample reached the learner twice"
    assert len(received) >= 6 * B * N, f"the run stalled after {kills} kills\n{cluster.dump_logs()}"
    core = ledger(journal, rollout)
    audit = core.audit()  # every admitted sample in one place; every accepted token accounted for
    assert audit["balanced"] and audit["expected"] == core.counters.groups_admitted * N, audit
    # Everything the learner got left the ledger as delivered: none of it is live there.
    assert not set(received) & set(core.samples) and audit["places"]["delivered"] >= len(received)


def test_a_generator_killed_mid_lease_is_finished_by_another(cluster, tmp_path):
    journal = tmp_path / "journal"
    rollout = dict(ROLLOUT, mode="async", staleness_bound=4)
    # Exactly the prompts of two batches: they cannot be delivered without the victim's samples.
    cluster.broker(rollout, journal=journal, extra={"prompts.limit": 2 * B})
    # gen-victim decodes slowly, so it is surely mid-lease (with chunks sent) when killed.
    cluster.generator("gen-victim", slots=4, lengths=[120], step_s_fixed=0.02)  # 2.4 s a response
    # Kill it once it is surely mid-lease with chunks sent: 0.6 s (~30 steps, chunks of 4) after
    # the broker has its hello, however long the process took to start.
    deadline = time.monotonic() + 30
    while "peer=gen-victim" not in cluster.logs["broker"].read_text():
        assert time.monotonic() < deadline, cluster.dump_logs()
        time.sleep(0.05)
    time.sleep(0.6)
    cluster.kill("gen-victim")
    cluster.generator("gen-rescue", slots=4, lengths=[120])
    cluster.scorer()
    batches = run_learner(cluster, 2, publish=False)
    for b in batches:
        check_batch_tokens(b)
    cluster.stop_all()
    c = ledger(journal, rollout).counters
    assert c.leases_expired >= 1 and c.partials_recycled >= 1 and c.tokens_resumed > 0, c
