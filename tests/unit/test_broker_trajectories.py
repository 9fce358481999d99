"""The broker's ledger of trajectories (issue 45, ``docs/agents.md``): a task in
``rollout.environments`` has its finished turns stepped by a scorer; an observation is appended as
context and the next turn is leased like a recycled partial, first; the batch carries the context
spans; every token is accounted for; the limits retire a group by name."""

from april_async.broker.config import RolloutConfig
from april_async.broker.core import BrokerCore, Place

OBS = [40, 41, 42]


def make(**kw) -> BrokerCore:
    base = dict(mode="async", batch_groups=1, group_size=2, over_provision=1.0, staleness_bound=1,
                max_response_tokens=16, lease_timeout_s=10.0, score_timeout_s=10.0, environments=["calc"],
                max_turns=3, turn_tokens=4)
    return BrokerCore(RolloutConfig(**{**base, **kw}))


def finish(core, grant, tokens, version=0, reason="stop"):
    return core.finish(grant.lease_id, len(grant.resume), tokens, [-0.5] * len(tokens),
                       [[version, len(tokens)]], reason, 1.0)


def test_a_trajectory_takes_observations_between_turns_and_is_delivered_with_its_context():
    core = make()
    core.admit("p0", [1, 2, 3], 0.0, task="calc", meta={"answer": "57"})
    grants = core.lease("gen", 10, 0.0)
    assert len(grants) == 2 and all(g.max_new_tokens == 4 for g in grants)  # a turn's budget
    a, b = grants
    finish(core, a, [7, 8])
    finish(core, b, [9])
    tasks = {t.sample_id: t for t in core.score_lease("scorer", 10, 1.0)}
    ta = tasks[a.sample_id]
    assert (ta.turn, ta.context, ta.takes_observation) == (0, (), True)
    assert core.observed(a.sample_id, ta.lease_id, OBS, 1.0) == []
    s = core.samples[a.sample_id]
    assert s.place is Place.PARTIAL and s.turn == 1 and s.context == ((2, 3),)
    assert list(s.tokens) == [7, 8, *OBS] and list(s.logprobs)[2:] == [0.0] * 3
    assert s.spans == ((0, 5),)  # the observation takes the version of the token before it
    core.scored(b.sample_id, tasks[b.sample_id].lease_id, 0.0, 1.0)  # b's first turn ended it
    again = core.lease("gen", 10, 1.0)[0]  # the next turn is leased first, resuming the whole trajectory
    assert again.sample_id == a.sample_id and again.resume == [7, 8, *OBS] and again.max_new_tokens == 4
    finish(core, again, [10, 11], version=1)
    t2 = core.score_lease("scorer", 10, 2.0)[0]
    assert (t2.turn, t2.context, t2.takes_observation) == (1, ((2, 3),), True)
    core.scored(a.sample_id, t2.lease_id, 1.0, 2.0)
    batch = core.pull_batch(3.0)
    out = {x.sample_id: x for x in batch.groups[0].samples}
    assert out[a.sample_id].context == ((2, 3),) and list(out[a.sample_id].tokens) == [7, 8, *OBS, 10, 11]
    assert out[b.sample_id].context == ()
    assert core.counters.observations == 1 and core.counters.tokens_observed == 3
    assert core.audit()["balanced"], core.audit()


def test_the_last_turn_takes_no_observation_and_the_limits_retire_by_name():
    core = make(max_turns=2, group_size=1)
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = core.lease("gen", 10, 0.0)[0]
    finish(core, g, [7])
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)
    g = core.lease("gen", 10, 1.0)[0]
    finish(core, g, [8])
    t = core.score_lease("scorer", 10, 1.0)[0]
    assert t.turn == 1 and not t.takes_observation  # max_turns = 2: this turn must end it
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)  # an environment that went on anyway
    assert core.counters.groups_retired == {"bad_step": 1}

    core = make(group_size=1, max_response_tokens=8)
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = core.lease("gen", 10, 0.0)[0]
    finish(core, g, [7, 7, 7, 7])
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.observed(g.sample_id, t.lease_id, [*OBS, 43], 1.0)  # 4 + 4 + 1 > 8: no room for another turn
    assert core.counters.groups_retired == {"context_full": 1}

    core = make(group_size=1)
    core.admit("p0", [1, 2, 3], 0.0, task="math")  # not a trajectory task
    g = core.lease("gen", 10, 0.0)[0]
    assert g.max_new_tokens == 16  # no turn budget either
    finish(core, g, [7])
    t = core.score_lease("scorer", 10, 1.0)[0]
    assert not t.takes_observation
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)
    assert core.counters.groups_retired == {"bad_step": 1}
    assert core.audit()["balanced"]


def test_a_trajectory_over_the_bound_keeps_its_tool_results_and_its_stale_turns_become_context():
    """``over_bound = "restart"`` restarts a single-turn sample; a trajectory instead has its stale
    tokens demoted to context (their versions no longer count) and goes on: the tool results it
    paid for are kept. ``drop`` retires it as any sample."""
    core = make(group_size=1, staleness_bound=0, mode="async")
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = core.lease("gen", 10, 0.0)[0]
    finish(core, g, [7, 8])
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)
    core.publish_version(1, 2.0)  # the held trajectory's version-0 tokens now break η = 0
    s = core.samples[g.sample_id]
    assert s.place is Place.PARTIAL and list(s.tokens) == [7, 8, *OBS] and s.turn == 1
    assert s.context == ((0, 5),) and s.spans == ((1, 5),)  # turn 0 and its observation: context
    assert (core.counters.restarts, core.counters.turns_demoted, core.counters.tokens_demoted) == (0, 1, 5)
    again = core.lease("gen", 10, 2.0)[0]
    core.finish(again.lease_id, 5, [9], [-0.5], [[1, 1]], "stop", 3.0)
    t = core.score_lease("scorer", 10, 3.0)[0]
    core.scored(g.sample_id, t.lease_id, 1.0, 3.0)
    out = core.pull_batch(4.0).groups[0].samples[0]
    assert out.context == ((0, 5),) and list(out.tokens) == [7, 8, *OBS, 9]  # only the 9 is trained
    assert core.audit()["balanced"]

    dropped = make(group_size=1, staleness_bound=0, mode="async", over_bound="drop")
    dropped.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = dropped.lease("gen", 10, 0.0)[0]
    finish(dropped, g, [7])
    dropped.publish_version(1, 2.0)
    assert dropped.counters.groups_retired == {"stale": 1}


def test_a_snapshot_keeps_the_context_and_the_turn():
    core = make(group_size=1)
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = core.lease("gen", 10, 0.0)[0]
    finish(core, g, [7])
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)
    back = BrokerCore.from_bytes(core.to_bytes())
    s = back.samples[g.sample_id]
    assert (s.context, s.turn, list(s.tokens)) == (((1, 3),), 1, [7, *OBS])
    assert back.audit()["balanced"]


def test_a_journal_of_a_trajectory_replays_to_the_same_ledger():
    from april_async.broker import records as r

    log = [r.Admit("p0", [1, 2, 3], 0.0, "calc", {}), r.Leases("gen", 10, 0.0)]
    core = make(group_size=1)
    for rec in log:
        r.apply(core, rec)
    g = core.leases[next(iter(core.leases))]
    log += [r.Finish(g.lease_id, 0, [7, 8], [-0.5, -0.5], [[0, 2]], "stop", 1.0),
            r.ScoreLeases("scorer", 10, 1.0)]
    for rec in log[2:]:
        r.apply(core, rec)
    observed = r.Observed(g.sample_id, g.lease_id, OBS, 1.0)
    assert r.decode(r.encode(observed)) == observed
    log.append(observed)
    r.apply(core, observed)
    replayed = make(group_size=1)
    for rec in log:
        r.apply(replayed, r.decode(r.encode(rec)))
    assert replayed.to_bytes() == core.to_bytes()
    assert replayed.samples[g.sample_id].context == ((2, 3),)


def test_a_turn_at_its_environment_is_in_a_place_of_its_own_and_keeps_its_group_in_the_step():
    core = make(mode="april", batch_groups=1, group_size=1, over_provision=1.0)
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    core.admit("p1", [1, 2, 4], 0.0, task="math")
    g = core.lease("gen", 1, 0.0)[0]
    finish(core, g, [7])
    assert core.samples[g.sample_id].place is Place.STEPPING and core.place_counts()["stepping"] == 1
    # a stepping group is not complete: no early termination, and it stays in the rollout step
    assert core.done_groups() == [] and core.counters.early_terminations == 0
    assert core.counters.turns_finished == 1 and core.counters.samples_finished == 0
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.publish_version(1, 1.0)
    assert g.group_id in core.step_groups
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)
    assert core.lease("gen", 1, 1.0)[0].sample_id == g.sample_id  # its next turn before the fresh group
    assert core.audit()["balanced"]


def test_a_failed_step_is_retried_by_the_named_policy_then_retired_and_a_snapshot_keeps_the_count():
    """``on_env_failure = "retry"``: an ``env_error`` / ``env_timeout`` sends the same step to a
    scorer again, ``env_retries`` times a turn (the count starts again after an observation), then
    the group retires under the failure's name; ``bad_step`` retires at once. ``retire`` (the
    default) retires at the first failure."""
    from april_async.broker import snapshot

    core = make(group_size=1, on_env_failure="retry", env_retries=2)
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = core.lease("gen", 10, 0.0)[0]
    finish(core, g, [7])
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.score_failed(g.sample_id, t.lease_id, 1.0, "env_timeout")
    again = core.score_lease("scorer", 10, 1.0)  # the same step, to a scorer again
    assert [(x.sample_id, x.lease_id, x.turn) for x in again] == [(g.sample_id, t.lease_id, 0)]
    core.observed(g.sample_id, t.lease_id, OBS, 1.0)  # the retry answered: the next turn
    s = core.samples[g.sample_id]
    assert s.turn == 1 and s.step_failures == 0 and core.counters.steps_retried == 1
    g = core.lease("gen", 10, 1.0)[0]
    finish(core, g, [8])
    for k in range(2):
        t = core.score_lease("scorer", 10, 2.0)[0]
        core.score_failed(g.sample_id, t.lease_id, 2.0, "env_error")
        assert core.samples[g.sample_id].step_failures == k + 1
        core = BrokerCore.from_bytes(snapshot.encode(core))  # a restart keeps the count
    t = core.score_lease("scorer", 10, 3.0)[0]
    core.score_failed(g.sample_id, t.lease_id, 3.0, "env_error")  # the third failure of this turn
    assert core.counters.groups_retired == {"env_error": 1} and core.counters.steps_retried == 3
    assert core.audit()["balanced"], core.audit()

    for kw, reason, retired in [({"on_env_failure": "retry"}, "bad_step", {"bad_step": 1}),
                                ({}, "env_error", {"env_error": 1})]:
        core = make(group_size=1, **kw)
        core.admit("p0", [1, 2, 3], 0.0, task="calc")
        g = core.lease("gen", 10, 0.0)[0]
        finish(core, g, [7])
        t = core.score_lease("scorer", 10, 1.0)[0]
        core.score_failed(g.sample_id, t.lease_id, 1.0, reason)
        assert core.counters.groups_retired == retired and core.counters.steps_retried == 0


def test_the_sample_clock_gives_quantiles_of_admission_to_reward_and_counts_turns():
    from april_async.broker.service import SampleClock

    clock = SampleClock(keep=1000)
    for k in range(100):
        clock.add(float(k + 1), 1 + k % 3)
    clock.add(-5.0, 2)  # a recovered ledger's admission from another host's clock: not timed
    out = clock.summary()
    assert out["n"] == 100 and (out["p50"], out["p90"], out["p99"], out["max"]) == (51.0, 91.0, 100.0, 100.0)
    assert out["turns"] == {"1": 34, "2": 34, "3": 33}
    assert SampleClock().summary() == {"n": 0, "max": None, "turns": {}}


def test_observations_count_against_the_context_budget_not_the_response_budget():
    """``max_response_tokens`` bounds the policy's tokens of a trajectory, ``max_context_tokens``
    every token after the prompt: an observation takes context, not response; the next turn gets
    what is left of both; a turn that spends the response budget ends at ``length`` and takes no
    observation. Without ``max_context_tokens`` one budget holds both (an observation past it is
    ``context_full``)."""
    import pytest
    from pydantic import ValidationError

    core = make(group_size=1, max_response_tokens=6, max_context_tokens=12, turn_tokens=None)
    core.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = core.lease("gen", 10, 0.0)[0]
    assert g.max_new_tokens == 6
    finish(core, g, [7, 7, 7, 7])
    t = core.score_lease("scorer", 10, 1.0)[0]
    assert t.takes_observation
    core.observed(g.sample_id, t.lease_id, [*OBS, 43, 44], 1.0)  # 4 + 5 + 1 <= 12: room for a turn
    g = core.lease("gen", 10, 1.0)[0]
    assert g.max_new_tokens == 2  # min(6 - 4 policy tokens, 12 - 9 held)
    core.finish(g.lease_id, 9, [8, 8, 8], [-0.5] * 3, [[0, 3]], "stop", 1.0)  # one past the budget: cut
    s = core.samples[g.sample_id]
    assert s.n_tokens == 11 and s.finish_reason == "length" and core.counters.tokens_over_budget == 1
    t = core.score_lease("scorer", 10, 2.0)[0]
    assert not t.takes_observation  # no response budget left for another turn
    core.scored(g.sample_id, t.lease_id, 1.0, 2.0)
    assert core.audit()["balanced"]

    one = make(group_size=1, max_response_tokens=8, turn_tokens=None)  # one budget for both
    one.admit("p0", [1, 2, 3], 0.0, task="calc")
    g = one.lease("gen", 10, 0.0)[0]
    finish(one, g, [7, 7, 7, 7])
    t = one.score_lease("scorer", 10, 1.0)[0]
    one.observed(g.sample_id, t.lease_id, [*OBS, 43], 1.0)  # 4 + 4 + 1 > 8
    assert one.counters.groups_retired == {"context_full": 1}
    with pytest.raises(ValidationError, match="max_context_tokens = 4 is below max_response_tokens = 8"):
        RolloutConfig(max_response_tokens=8, max_context_tokens=4)
