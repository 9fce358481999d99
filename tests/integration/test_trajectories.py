"""Trajectories end to end (issue 45): a real broker holding trajectories, a real generator (the
scripted test engine), a real scorer stepping an environment, and this process as the learner, all
separate processes on loopback. Each sample takes two turns: the environment answers the first with
an observation, which the broker appends as context and the generator resumes after; the second
ends it with a reward. The batches carry the context spans, and every other token is the policy's."""

from __future__ import annotations

import time

from april_async.agents.env import Continue, Done, Trajectory
from april_async.engines.scripted import scripted_token
from april_async.model.tokenizer import CharTokenizer
from april_async.testing.cluster import Cluster

HERE = "tests.integration.test_trajectories"
OBSERVATION = "= 1"
B, N, TURN = 2, 2, 4


class EnvOneObservation:
    """A tool call on the first turn, answered; the reward after the second."""

    def step(self, t: Trajectory):
        if t.turn == 0 and not t.last_turn:
            return Continue(OBSERVATION)
        return Done(1.0)


def test_two_turn_trajectories_reach_the_learner_with_their_observations_as_context(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.broker({"mode": "async", "batch_groups": B, "group_size": N, "over_provision": 1.0,
                    "staleness_bound": 4, "environments": ["scripted"], "max_turns": 3, "turn_tokens": TURN})
    cluster.generator("gen-0", slots=4, lengths=[12])
    cluster.scorer(**{"environments.scripted": f"{HERE}:EnvOneObservation"})
    learner = cluster.learner()
    obs = CharTokenizer().encode(OBSERVATION)
    batches = []
    try:
        deadline = time.monotonic() + 60
        while len(batches) < 2:
            assert time.monotonic() < deadline, cluster.dump_logs()
            cluster.assert_alive()
            batch = learner.next_batch(1.0)
            if batch is not None:
                batches.append(batch)
                learner.publish(batch.policy_version + 1)
    finally:
        learner.close()
        codes = cluster.stop_all()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{cluster.dump_logs()}"
    for batch in batches:
        for g in batch.groups:
            for s in g.samples:
                toks = batch.response_tokens[s.response_offset:s.response_offset + s.response_len].tolist()
                assert [(c.offset, c.count) for c in s.context] == [(TURN, len(obs))], s
                assert toks[TURN:TURN + len(obs)] == obs and s.reward == 1.0
                policy = [p for p in range(len(toks)) if not TURN <= p < TURN + len(obs)]
                assert [toks[p] for p in policy] == [scripted_token(s.sample_id, p, 1000) for p in policy]
                assert len(toks) == 2 * TURN + len(obs)  # two turns of the turn budget, the observation


def test_a_turn_ends_at_a_turn_stop_token_on_the_generator(tmp_path):
    """``rollout.turn_stop_token_ids`` go out with a trajectory's leases: here the scripted engine's
    token at position 2 of each sample ends its first turn (``stop``), after 3 tokens."""
    cluster = Cluster(tmp_path)
    stops = [scripted_token(sid, 2, 1000) for sid in range(30)]  # 31 apart: no sample writes another's
    cluster.broker({"mode": "async", "batch_groups": B, "group_size": N, "over_provision": 1.0,
                    "staleness_bound": 4, "environments": ["scripted"], "max_turns": 3, "turn_tokens": TURN,
                    "turn_stop_token_ids": stops})
    cluster.generator("gen-0", slots=4, lengths=[12])
    cluster.scorer(**{"environments.scripted": f"{HERE}:EnvOneObservation"})
    learner = cluster.learner()
    obs = CharTokenizer().encode(OBSERVATION)
    try:
        deadline = time.monotonic() + 60
        batch = None
        while batch is None:
            assert time.monotonic() < deadline, cluster.dump_logs()
            cluster.assert_alive()
            batch = learner.next_batch(1.0)
    finally:
        learner.close()
        codes = cluster.stop_all()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{cluster.dump_logs()}"
    for g in batch.groups:
        for s in g.samples:
            assert [(c.offset, c.count) for c in s.context] == [(3, len(obs))], s
