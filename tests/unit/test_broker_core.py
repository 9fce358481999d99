"""Scenario tests of the broker core: each reads as one behaviour of the APRIL policy."""

import msgpack
import pytest
from pydantic import ValidationError

from april_async.broker.config import RolloutConfig
from april_async.broker.core import AbortLease, BrokerCore, BrokerError, Place


def make(**kw) -> BrokerCore:
    base = dict(mode="april", batch_groups=2, group_size=2, over_provision=2.0, staleness_bound=1,
                max_response_tokens=8, lease_timeout_s=10.0, score_timeout_s=10.0)
    return BrokerCore(RolloutConfig(**{**base, **kw}))


def admit(core, k, start=0):
    return [core.admit(f"p{start + i}", [1, 2, 3], 0.0) for i in range(k)]


def finish(core, grant, n_tokens=2, reason="stop", version=0, offset=None):
    toks = [7] * n_tokens
    off = len(grant.resume) if offset is None else offset
    return core.finish(grant.lease_id, off, toks, [-0.5] * n_tokens, [[version, n_tokens]] if n_tokens else [], reason, 1.0)


def score_all(core, reward=1.0):
    for t in core.score_lease("scorer", 1000, 1.0):
        core.scored(t.sample_id, t.lease_id, reward, 1.0)


def test_april_terminates_early_and_recycles_partials_first_with_the_remaining_budget():
    core = make()
    admit(core, 6)
    grants = core.lease("gen", 100, 0.0)
    # ceil(r·B) = 4 groups × n = 2 samples in flight, no more.
    assert len(grants) == 8 and core.leased_groups() == 4
    by_group = {}
    for g in grants:
        by_group.setdefault(g.group_id, []).append(g)
    g0, g1, g2, g3 = (by_group[k] for k in sorted(by_group))
    core.chunk(g2[0].lease_id, 0, [5, 5, 5], [-1.0] * 3, [[0, 3]], 1.0)
    assert finish(core, g0[0]) == [] and finish(core, g0[1]) == []
    finish(core, g1[0])
    effects = finish(core, g1[1])
    # B = 2 groups complete: everything still in flight is aborted.
    assert {e.lease_id for e in effects} == {g.lease_id for g in g2 + g3}
    assert core.counters.early_terminations == 1
    assert core.lease("gen", 10, 1.0) == []  # the step is over until the learner publishes
    for g in g2 + g3:
        finish(core, g, n_tokens=0, reason="abort")
    assert core.samples[g2[0].sample_id].place is Place.PARTIAL
    assert list(core.samples[g2[0].sample_id].tokens) == [5, 5, 5]  # a partial keeps its tokens
    score_all(core)
    batch = core.pull_batch(2.0)
    assert [g.group_id for g in batch.groups] == [g0[0].group_id, g1[0].group_id]
    core.publish_version(1, 3.0)
    resumed = core.lease("gen", 100, 3.0)
    # Partials first, in the order they came back, then fresh groups.
    assert [r.sample_id for r in resumed[:4]] == [g.sample_id for g in g2 + g3]
    assert resumed[0].resume == [5, 5, 5] and resumed[0].max_new_tokens == 8 - 3
    assert core.counters.partials_recycled == 1 and core.counters.tokens_resumed == 3
    # Where it was resumed is kept, through a snapshot, and leaves with the sample in its batch: the
    # learner reads from it which tokens were prefilled again (not mixed, see learner.mixed_mask).
    s = core.samples[g2[0].sample_id]
    assert s.resumed_at == (3,) and core.samples[g2[1].sample_id].resumed_at == ()
    assert BrokerCore.from_bytes(core.to_bytes()).samples[s.sample_id].resumed_at == (3,)
    for r in resumed[:4]:  # the partials of groups 2 and 3: two whole groups, a batch
        finish(core, r, n_tokens=2, version=1)
    score_all(core)
    out = {x.sample_id: x for g in core.pull_batch(4.0).groups for x in g.samples}
    assert out[s.sample_id].resumed_at == (3,) and out[s.sample_id].spans == ((0, 3), (1, 2))


def test_a_staleness_restart_forgets_where_the_sample_was_resumed():
    core = make(staleness_bound=0, batch_groups=1, group_size=1, over_provision=2.0)
    admit(core, 2)
    first = core.lease("gen", 100, 0.0)
    core.chunk(first[1].lease_id, 0, [5, 5], [-1.0] * 2, [[0, 2]], 0.5)
    finish(core, first[0])  # B = 1 group complete: the other is aborted
    finish(core, first[1], n_tokens=0, reason="abort", offset=2)
    score_all(core)
    core.pull_batch(1.0)
    core.publish_version(1, 2.0)  # version 0's tokens break η = 0: restarted, tokens dropped
    s = core.samples[first[1].sample_id]
    assert s.n_tokens == 0 and s.resumed_at == ()


def test_sync_mode_runs_exactly_B_groups_per_step_and_waits_for_the_learner():
    core = make(mode="sync", over_provision=1.0, staleness_bound=0, batch_groups=2)
    admit(core, 5)
    grants = core.lease("gen", 100, 0.0)
    assert len(grants) == 4 and core.leased_groups() == 2
    for g in grants[:3]:
        assert finish(core, g) == []  # no early termination in sync
    assert core.lease("gen", 100, 1.0) == []  # no over-provisioning while one group runs
    finish(core, grants[3])
    score_all(core)
    assert core.pull_batch(1.0) is not None
    assert core.lease("gen", 100, 1.0) == []  # trains between rollout steps
    core.publish_version(1, 2.0)
    assert len(core.lease("gen", 100, 2.0)) == 4


def test_async_keeps_generating_and_bounds_inflight_groups():
    core = make(mode="async", over_provision=1.5, batch_groups=2)
    admit(core, 10)
    grants = core.lease("gen", 100, 0.0)
    assert core.leased_groups() == 3 and len(grants) == 6
    finish(core, grants[0]), finish(core, grants[1])  # one group done: no abort in async
    assert len(core.leases) == 4
    more = core.lease("gen", 100, 1.0)
    assert len(more) == 2 and core.leased_groups() == 3


def test_async_with_per_step_admission_starts_at_most_ceil_rB_groups_a_version_without_pausing():
    core = make(mode="async", over_provision=1.5, batch_groups=2, staleness_bound=4, async_admission="per_step")
    admit(core, 10)
    grants = core.lease("gen", 100, 0.0)
    assert core.leased_groups() == 3 and len(grants) == 6
    by_group = {}
    for g in grants:
        by_group.setdefault(g.group_id, []).append(g)
    g0, g1, g2 = (by_group[k] for k in sorted(by_group))
    for g in g0 + g1:
        assert finish(core, g) == []  # B groups complete: nothing aborted, no boundary
    # Continuous async would start two more groups now; APRIL's count allows 3 in this version.
    assert core.lease("gen", 100, 1.0) == [] and core.leased_groups() == 1
    score_all(core)
    assert len(core.pull_batch(1.0).groups) == 2
    assert core.lease("gen", 100, 1.5) == []  # no new version yet: the count holds
    assert core.publish_version(1, 2.0) == []  # a version is a step; the leased group counts in it
    assert core.step_groups == {g2[0].group_id}
    more = core.lease("gen", 100, 2.0)
    assert len(more) == 4 and core.leased_groups() == 3
    assert len(core.step_groups) == 3
    assert core.counters.early_terminations == 0 and core.counters.aborts_sent == 0


def test_a_batch_the_learner_skipped_reopens_the_per_step_count_of_async():
    core = make(mode="async", over_provision=1.0, batch_groups=2, staleness_bound=4, async_admission="per_step")
    admit(core, 6)
    for g in core.lease("gen", 100, 0.0):
        finish(core, g)
    score_all(core)
    batch = core.pull_batch(1.0)
    assert core.lease("gen", 100, 1.0) == []  # ceil(r·B) = 2 groups leased in version 0
    core.report_batch(batch.batch_id, 0, [g.group_id for g in batch.groups], "zero_variance")
    assert core.counters.steps_skipped == 1
    assert len(core.lease("gen", 100, 1.0)) == 4  # no step taken: the count starts again


def test_continuous_async_admission_counts_no_steps():
    core = make(mode="async", over_provision=1.5, batch_groups=2)
    assert core.config.async_admission == "continuous" and not core.config.counts_steps
    admit(core, 4)
    core.lease("gen", 100, 0.0)
    assert core.step_groups == set()


@pytest.mark.parametrize("mode", ["sync", "april"])
def test_per_step_admission_is_refused_outside_async(mode):
    extra = {"over_provision": 1.0, "staleness_bound": 0} if mode == "sync" else {}
    with pytest.raises(ValidationError, match=f"'per_step' is a choice of mode 'async' only, not '{mode}'"):
        RolloutConfig(mode=mode, async_admission="per_step", **extra)


def test_a_snapshot_keeps_the_per_step_count_of_async():
    core = make(mode="async", over_provision=1.5, batch_groups=2, async_admission="per_step")
    admit(core, 6)
    core.lease("gen", 100, 0.0)
    back = BrokerCore.from_bytes(core.to_bytes())
    assert back.config.async_admission == "per_step" and back.step_groups == core.step_groups
    assert back.lease("gen", 100, 1.0) == []


def test_staleness_restart_drops_tokens_counts_them_and_regenerates():
    core = make(staleness_bound=1, over_bound="restart")
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    finish(core, g, n_tokens=3, version=0)
    core.publish_version(1, 1.0)  # lag 1 = η: still fine
    assert core.samples[g.sample_id].place is Place.FINISHED
    core.publish_version(2, 1.0)  # lag 2 > η
    s = core.samples[g.sample_id]
    assert s.place is Place.PARTIAL and list(s.tokens) == [] and s.finished_by is None
    assert core.counters.restarts == 1 and core.counters.tokens_discarded == 3
    again = core.lease("gen", 1, 2.0)[0]
    assert again.sample_id == g.sample_id and again.resume == [] and again.max_new_tokens == 8


def test_staleness_drop_retires_the_whole_group_and_aborts_its_leases():
    core = make(staleness_bound=0, over_bound="drop")
    admit(core, 1)
    a, b = core.lease("gen", 2, 0.0)
    finish(core, a, version=0)
    core.chunk(b.lease_id, 0, [1], [-1.0], [[0, 1]], 0.5)
    effects = core.publish_version(1, 1.0)
    assert effects == [AbortLease("gen", b.lease_id)]
    assert core.place_counts()["retired"] == 2 and core.counters.groups_retired == {"stale": 1}
    assert core.finish(b.lease_id, 1, [], [], [], "abort", 2.0) == []  # late report: a no-op
    assert core.counters.stale_reports == 1


def test_leased_sample_whose_tokens_break_the_bound_is_aborted_at_the_version_bump():
    core = make(mode="async", staleness_bound=0)
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    core.chunk(g.lease_id, 0, [1, 2], [-1.0, -1.0], [[0, 2]], 0.5)
    assert core.publish_version(1, 1.0) == [AbortLease("gen", g.lease_id)]
    assert core.publish_version(1, 1.0) == []  # the same version again: a no-op
    finish(core, g, n_tokens=1, reason="abort", version=1)
    s = core.samples[g.sample_id]
    assert s.place is Place.PARTIAL and list(s.tokens) == []  # restarted: version-0 tokens were over η


def test_silent_generator_loses_its_leases_as_partials_heartbeats_keep_them():
    core = make(lease_timeout_s=5.0)
    admit(core, 1)
    a, b = core.lease("gen-a", 1, 0.0) + core.lease("gen-b", 1, 0.0)
    core.chunk(a.lease_id, 0, [4, 4], [-1.0, -1.0], [[0, 2]], 1.0)
    core.touch("gen-b", 4.0)
    core.expire(6.0)
    assert core.samples[a.sample_id].place is Place.PARTIAL
    assert list(core.samples[a.sample_id].tokens) == [4, 4]
    assert core.samples[b.sample_id].place is Place.LEASED
    assert core.counters.leases_expired == 1
    assert core.chunk(a.lease_id, 2, [9], [-1.0], [[0, 1]], 6.5) is False  # the old lease is over


def test_chunks_are_idempotent_by_offset_and_a_gap_is_ignored():
    core = make()
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    assert core.chunk(g.lease_id, 0, [1, 2], [-1.0, -2.0], [[0, 2]], 0.1)
    assert core.chunk(g.lease_id, 0, [1, 2], [-1.0, -2.0], [[0, 2]], 0.2)  # duplicate: nothing new
    assert core.chunk(g.lease_id, 1, [2, 3], [-2.0, -3.0], [[0, 1], [1, 1]], 0.3)  # overlap: tail
    assert not core.chunk(g.lease_id, 5, [9], [-1.0], [[1, 1]], 0.4)  # gap
    s = core.samples[g.sample_id]
    assert list(s.tokens) == [1, 2, 3] and list(s.logprobs) == [-1.0, -2.0, -3.0]
    assert s.spans == ((0, 2), (1, 1))
    assert core.counters.tokens_duplicate == 3 and core.counters.chunk_gaps == 1
    # A finish whose start never arrived: the sample is resumed from what the broker holds.
    core.finish(g.lease_id, 7, [1], [-1.0], [[1, 1]], "stop", 0.5)
    assert s.place is Place.PARTIAL and list(s.tokens) == [1, 2, 3]


def test_a_chunk_with_a_value_that_is_not_a_number_is_refused_and_changes_nothing():
    core = make()
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    assert core.chunk(g.lease_id, 0, [1, 2], [-1.0, -2.0], [[0, 2]], 0.1)
    with pytest.raises(BrokerError, match="not a number"):
        core.chunk(g.lease_id, 2, [3, 4], [-3.0, "x"], [[0, 2]], 0.2)
    s = core.samples[g.sample_id]
    assert list(s.tokens) == [1, 2] and list(s.logprobs) == [-1.0, -2.0] and s.spans == ((0, 2),)


def test_token_arrays_leave_with_the_batch_and_numpy_chunks_are_taken():
    """The ledger holds tokens in arrays (the collector does not walk them); a delivered sample leaves it."""
    np = pytest.importorskip("numpy")
    core = make(batch_groups=1, group_size=1, over_provision=1.0)
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    core.finish(g.lease_id, 0, np.array([5, 6], dtype=np.int32), np.array([-0.5, -0.25], dtype=np.float32),
                [[0, 2]], "stop", 0.1)
    score_all(core)
    (sample,) = core.pull_batch(0.2).groups[0].samples
    assert list(sample.tokens) == [5, 6] and list(sample.logprobs) == [-0.5, -0.25]
    assert sample.spans == ((0, 2),)
    assert g.sample_id not in core.samples and core.place_counts()["delivered"] == 1 and core.audit()["balanced"]


def test_a_new_version_restarts_stale_partials_in_the_order_they_last_moved():
    """Only the samples a version can make stale are visited, in the order a scan of every live
    sample would give (the order of the partials it makes)."""
    core = make(mode="async", batch_groups=4, group_size=1, over_provision=1.0, staleness_bound=0,
                max_attempts=10)
    admit(core, 4)
    a, b, c, d = core.lease("gen", 4, 0.0)
    for grant, version in ((c, 0), (a, 0), (d, 1), (b, 0)):  # c, a, b become partials, in that order
        finish(core, grant, n_tokens=1, reason="abort", version=version)
    assert core.recycle_queue() == [c.sample_id, a.sample_id, d.sample_id, b.sample_id]
    core.publish_version(1, 2.0)  # version 0 is now over η = 0: c, a, b restart, d keeps its tokens
    assert core.counters.restarts == 3 and list(core.samples[d.sample_id].tokens) == [7]
    assert core.recycle_queue() == [d.sample_id, c.sample_id, a.sample_id, b.sample_id]


def test_tokens_past_the_budget_are_ignored_and_the_sample_ends_by_length():
    core = make(max_response_tokens=3)
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    core.finish(g.lease_id, 0, [1, 2, 3, 4], [-1.0] * 4, [[0, 4]], "abort", 0.5)
    s = core.samples[g.sample_id]
    assert s.place is Place.FINISHED and s.finish_reason == "length" and list(s.tokens) == [1, 2, 3]
    assert core.counters.tokens_over_budget == 1


def test_score_is_tied_to_the_response_it_was_asked_for():
    core = make(staleness_bound=0)
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    finish(core, g)
    (task,) = core.score_lease("scorer", 10, 1.0)
    core.publish_version(1, 1.0)  # the response is restarted before its score arrives
    assert core.scored(task.sample_id, task.lease_id, 1.0, 2.0) == []
    assert core.samples[g.sample_id].place is Place.PARTIAL and core.counters.stale_scores == 1


def test_a_failing_reward_retires_the_group_with_a_counted_reason():
    core = make(group_size=2)
    admit(core, 1)
    a, b = core.lease("gen", 2, 0.0)
    finish(core, a)
    (task,) = core.score_lease("scorer", 10, 1.0)
    effects = core.score_failed(task.sample_id, task.lease_id, 1.0)
    assert effects == [AbortLease("gen", b.lease_id)]
    assert core.counters.groups_retired == {"score_error": 1} and core.counters.score_errors == 1
    assert core.place_counts()["retired"] == 2


def test_unanswered_score_requests_are_offered_again():
    core = make(score_timeout_s=5.0)
    admit(core, 1)
    finish(core, core.lease("gen", 1, 0.0)[0])
    assert len(core.score_lease("scorer-a", 10, 1.0)) == 1
    assert core.score_lease("scorer-b", 10, 2.0) == []
    core.expire(7.0)
    assert len(core.score_lease("scorer-b", 10, 7.0)) == 1 and core.counters.score_timeouts == 1


def test_batch_accounts_staleness_and_off_policy_tokens():
    core = make(mode="async", batch_groups=1, group_size=1, staleness_bound=2)
    admit(core, 1)
    g = core.lease("gen", 1, 0.0)[0]
    core.chunk(g.lease_id, 0, [1, 2], [-1.0, -1.0], [[0, 2]], 0.1)
    core.publish_version(1, 0.2)
    core.finish(g.lease_id, 2, [3], [-1.0], [[1, 1]], "stop", 0.3)
    score_all(core)
    batch = core.pull_batch(0.4)
    (sample,) = batch.groups[0].samples
    assert list(sample.tokens) == [1, 2, 3] and sample.spans == ((0, 2), (1, 1))
    c = core.counters
    assert c.off_policy_tokens == 2
    assert c.staleness_tokens == {"1": 2, "0": 1} and c.staleness_samples == {"1": 1}  # lags as strings
    assert core.pull_batch(0.5) is None


def test_duplicate_prompt_is_a_noop_and_bad_prompts_are_refused():
    core = make(max_prompt_tokens=4)
    assert core.admit("p", [1], 0.0) == 0
    assert core.admit("p", [1], 0.0) is None and core.counters.duplicate_prompts == 1
    with pytest.raises(BrokerError, match="'q' has 5 tokens, over max_prompt_tokens=4"):
        core.admit("q", [1] * 5, 0.0)
    with pytest.raises(BrokerError, match="'r' is empty"):
        core.admit("r", [], 0.0)


def test_snapshot_round_trip_keeps_queue_order_leases_and_counters():
    core = make()
    admit(core, 3)
    grants = core.lease("gen", 3, 0.0)
    finish(core, grants[0], reason="abort")
    restored = BrokerCore.from_bytes(core.to_bytes())
    assert restored.to_bytes() == core.to_bytes()
    assert restored.recycle_queue() == core.recycle_queue() and restored.fresh_queue() == core.fresh_queue()
    assert restored.leases_of("gen") == core.leases_of("gen")
    restored.rebase_deadlines(100.0)
    assert all(lease.deadline == 110.0 for lease in restored.leases.values())


def test_corrupt_or_foreign_snapshot_is_refused():
    core = make()
    admit(core, 1)
    import msgpack

    state = msgpack.unpackb(core.to_bytes())
    state["queues"]["fresh"] = []
    with pytest.raises(BrokerError, match="queue 'fresh' does not match"):
        BrokerCore.from_bytes(msgpack.packb(state))
    state["format"] = 99
    with pytest.raises(BrokerError, match="snapshot format 99"):
        BrokerCore.from_bytes(msgpack.packb(state))
    with pytest.raises(BrokerError, match="group_size=2, config says 3"):
        BrokerCore.from_bytes(core.to_bytes(), RolloutConfig(group_size=3))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(batch_groups=0), "batch_groups"),
        (dict(over_provision=0.5), "over_provision"),
        (dict(staleness_bound=-1), "staleness_bound"),
        (dict(over_bound="keep"), "over_bound"),
        (dict(mode="fast"), "mode"),
        (dict(mode="sync", over_provision=2.0, staleness_bound=0), "over_provision = 1"),
        (dict(mode="sync", over_provision=1.0, staleness_bound=1), "staleness_bound = 0"),
        (dict(batch_size=8), "batch_size"),  # a field that does not exist fails loudly
    ],
)
def test_bad_config_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValidationError, match=field):
        RolloutConfig(**kw)


def test_inflight_bound_is_ceil_of_r_times_B():
    assert RolloutConfig(batch_groups=3, over_provision=1.5).max_inflight_groups == 5
    assert RolloutConfig(batch_groups=4, over_provision=1.5, group_size=3).max_inflight_samples == 18
    assert RolloutConfig(batch_groups=4, over_provision=1.0).max_inflight_groups == 4


def test_score_failure_is_counted_under_the_scorers_reason():
    core = make()
    admit(core, 1)
    for g in core.lease("gen", 100, 0.0):
        finish(core, g)
    t = core.score_lease("scorer", 10, 1.0)[0]
    core.score_failed(t.sample_id, t.lease_id, 1.0, "reward_timeout")
    assert core.counters.groups_retired == {"reward_timeout": 1}
    assert t.sample_id not in core.samples and core.place_counts()["retired"] == 2 and core.audit()["balanced"]


def _april_batch(core):
    admit(core, 2)
    for g in core.lease("gen", 100, 0.0):
        finish(core, g)
    score_all(core)
    batch = core.pull_batch(1.0)
    admit(core, 2, start=2)
    return batch


def test_a_batch_the_learner_skipped_reopens_the_rollout_step():
    core = make()
    batch = _april_batch(core)
    assert core.lease("gen", 100, 2.0) == []  # waits for a newer version
    core.report_batch(batch.batch_id, 0, [g.group_id for g in batch.groups], "zero_variance")
    assert core.counters.groups_filtered == {"zero_variance": 2}
    assert core.counters.steps_skipped == 1
    assert core.lease("gen", 100, 2.0) != []  # no version will come for it: the step reopens


def test_a_batch_report_with_a_step_counts_drops_and_waits_for_the_version():
    core = make()
    batch = _april_batch(core)
    core.report_batch(batch.batch_id, 1, [batch.groups[0].group_id], "zero_variance")
    assert core.counters.groups_filtered == {"zero_variance": 1} and core.counters.steps_skipped == 0
    assert core.lease("gen", 100, 2.0) == []  # the version itself opens the next step
    core.report_batch(99, 1, [1], "zero_variance")  # a batch never made: ignored, counted
    assert core.counters.stale_reports == 1 and core.counters.groups_filtered == {"zero_variance": 1}


def test_a_sample_the_engine_refused_retires_its_group_and_is_never_leased_again():
    core = make(mode="async", group_size=2)
    admit(core, 1)
    a, b = core.lease("gen", 2, 0.0)
    core.chunk(a.lease_id, 0, [5, 5], [-1.0, -1.0], [[0, 2]], 0.5)
    effects = core.finish(a.lease_id, 2, [], [], [], "error", 1.0)
    assert effects == [AbortLease("gen", b.lease_id)]  # the group's other lease is stopped
    assert a.group_id not in core.groups
    assert core.counters.groups_retired == {"engine_refused": 1} and core.counters.tokens_retired == 2
    assert core.lease("gen", 10, 2.0) == []  # nothing of it comes back as a partial
    assert core.place_counts()["retired"] == 2 and core.audit()["balanced"]


def test_no_sample_gets_more_than_max_attempts_leases_whatever_ends_them():
    core = make(mode="async", group_size=1, max_attempts=3)
    admit(core, 1)
    for attempt in range(3):
        (g,) = core.lease("gen", 1, float(attempt))
        effects = finish(core, g, n_tokens=1, reason="abort")  # a server's own abort, say
    assert effects == [] and g.sample_id not in core.samples and core.place_counts()["retired"] == 1
    assert core.counters.groups_retired == {"attempts_exhausted": 1}
    assert core.lease("gen", 1, 5.0) == []
    # A silent generator's reclaimed lease counts the same.
    core2 = make(mode="async", group_size=1, max_attempts=1)
    admit(core2, 1)
    core2.lease("gen", 1, 0.0)
    core2.expire(100.0)
    assert core2.counters.groups_retired == {"attempts_exhausted": 1}


def test_april_with_an_inflight_boundary_keeps_leases_decoding_across_steps_within_eta():
    core = make(boundary="inflight", staleness_bound=1)
    admit(core, 6)
    grants = core.lease("gen", 100, 0.0)
    by_group = {}
    for g in grants:
        by_group.setdefault(g.group_id, []).append(g)
    g0, g1, g2, g3 = (by_group[k] for k in sorted(by_group))
    core.chunk(g2[0].lease_id, 0, [5, 5, 5], [-1.0] * 3, [[0, 3]], 1.0)
    for g in g0 + g1[:1]:
        assert finish(core, g) == []
    # B = 2 groups complete: nothing is aborted, the other leases keep decoding...
    assert finish(core, g1[1]) == [] and core.counters.early_terminations == 0
    assert core.lease("gen", 10, 1.0) == []  # ...but no new group starts before the next step
    score_all(core)
    assert len(core.pull_batch(2.0).groups) == 2
    assert core.publish_version(1, 3.0) == []  # version 0 is within η = 1 of version 1
    # The lease goes on where it was: its next chunk, made by version 1, lands after the first three.
    assert core.chunk(g2[0].lease_id, 3, [6, 6], [-1.0] * 2, [[1, 2]], 3.5)
    s = core.samples[g2[0].sample_id]
    assert list(s.tokens) == [5, 5, 5, 6, 6] and s.spans == ((0, 3), (1, 2)) and s.attempts == 1
    assert core.counters.partials_recycled == 0 and core.counters.tokens_resumed == 0  # nothing re-prefilled
    # Version 2 puts its version-0 tokens past η: that lease alone is aborted, as in async.
    effects = core.publish_version(2, 4.0)
    assert effects == [AbortLease("gen", g2[0].lease_id)]


def test_an_inflight_boundary_is_refused_outside_april():
    with pytest.raises(ValidationError, match="boundary 'inflight' is a choice of mode 'april' only"):
        RolloutConfig(mode="async", boundary="inflight")


def test_the_old_name_continue_is_read_as_inflight_with_one_warning(monkeypatch):
    import warnings

    from april_async.broker import config as broker_config

    monkeypatch.setattr(broker_config, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = RolloutConfig(mode="april", boundary="continue")
        second = RolloutConfig.model_validate({"mode": "april", "boundary": "continue"})
    assert first.boundary == second.boundary == "inflight"
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == [
        "broker.rollout.boundary = 'continue' is deprecated: it is 'inflight' now (APRIL's admission with "
        "PipelineRL's in-flight weight updates; nothing is aborted or recycled)"]
    with pytest.raises(ValidationError, match="boundary"):
        RolloutConfig(mode="april", boundary="go-on")


def test_a_snapshot_that_holds_the_old_name_continue_restores_as_inflight():
    core = make(boundary="inflight", staleness_bound=1)
    admit(core, 2)
    data = bytearray(core.to_bytes())
    at = data.find(b"inflight")
    assert at >= 0 and data.find(b"inflight", at + 1) < 0
    old = bytes(data[:at]) + b"continue" + bytes(data[at + len(b"inflight"):])  # same length: a msgpack str of 8
    assert BrokerCore.from_bytes(old).config.boundary == "inflight"


def test_fifo_set_keeps_arrival_order_through_removals_re_adds_and_compaction():
    import gc

    from april_async.broker.core import FifoSet

    q = FifoSet([5, 6, 7])
    q[5] = None  # already in: stays first, as a dict's key would
    assert list(q) == [5, 6, 7] and q.first() == 5 and len(q) == 3
    del q[5]
    q.pop(6)
    q[5] = None  # re-added: now at the back, its old entry is dead
    assert list(q) == [7, 5] and q.first() == 7 and 6 not in q and 5 in q
    assert q.pop(123, "absent") == "absent"
    model = [7, 5]
    for i in range(10_000):  # enough dead entries at the front to compact the order array
        q[1000 + i] = None
        model.append(1000 + i)
        if i % 3 == 0:
            victim = model.pop(0)
            del q[victim]
        if i % 7 == 0:
            victim = model.pop(len(model) // 2)
            q.pop(victim)
        assert q.first() == model[0]
    assert list(q) == model and len(q) == len(model)
    assert FifoSet.fromkeys(model) is not q and list(FifoSet.fromkeys(model)) == model
    assert not gc.is_tracked(q._members)  # the membership dict is not walked by full collections


def _ready_groups(core, k, version=0, reward=1.0):
    """Admit, lease, finish and score ``k`` whole groups; the grants, by group."""
    admit(core, k, start=len(core.groups) + core.counters.groups_admitted)
    grants = core.lease("gen", 1000, 0.0)
    for g in grants:
        finish(core, g, version=version)
    score_all(core, reward)
    return grants


def test_a_batch_packed_in_slices_is_the_batch_packed_whole():
    """``pull_batch(now, max_samples)`` moves about that many samples a call; the last call returns
    the very batch one call would, and the counters and the audit agree at every slice."""
    whole, sliced = (make(mode="async", batch_groups=3, group_size=2, over_provision=4.0) for _ in range(2))
    for core in (whole, sliced):
        _ready_groups(core, 4)
    expected = whole.pull_batch(1.0)
    calls = []
    while (batch := sliced.pull_batch(1.0, max_samples=1)) is None:
        calls.append(sliced.audit())
        assert sliced.batch_pending()
    assert len(calls) == 2  # three groups, one a call
    assert all(a["balanced"] for a in calls)
    assert batch == expected and sliced.counters == whole.counters and sliced.to_bytes() == whole.to_bytes()
    assert not sliced.batch_pending()  # one ready group left, B = 3


def test_a_version_during_packing_leaves_the_batch_in_bound_at_its_version():
    """The batch is chosen and versioned at its first slice: a newer version that would make its
    samples stale neither restarts them nor changes what the learner gets."""
    core = make(mode="async", batch_groups=2, group_size=2, staleness_bound=0, over_provision=4.0)
    _ready_groups(core, 3)
    assert core.pull_batch(1.0, max_samples=1) is None
    core.publish_version(1, 1.5)  # every held sample is now over η = 0
    assert core.counters.restarts == 2  # the third group's two samples, not the batch's
    batch = core.pull_batch(2.0, max_samples=1)
    assert batch is not None and batch.policy_version == 0 and len(batch.groups) == 2
    assert all(len(s.tokens) == 2 for g in batch.groups for s in g.samples)
    assert core.audit()["balanced"]


def test_sync_leasing_stays_closed_while_a_batch_is_packed():
    core = make(mode="sync", batch_groups=2, group_size=2, over_provision=1.0, staleness_bound=0)
    _ready_groups(core, 2)
    admit(core, 2, start=10)
    assert core.pull_batch(1.0, max_samples=1) is None
    assert core.lease("gen", 10, 1.0) == []  # the step is over: the batch is chosen
    assert core.pull_batch(1.0, max_samples=1) is not None
    assert core.lease("gen", 10, 1.0) == []
    core.publish_version(1, 2.0)
    assert len(core.lease("gen", 10, 2.0)) == 4


def test_a_snapshot_taken_while_a_batch_is_packed_restores_it():
    """A crash between two slices: the restored core finishes the same batch."""
    core = make(mode="async", batch_groups=3, group_size=2, over_provision=4.0)
    _ready_groups(core, 4)
    assert core.pull_batch(1.0, max_samples=4) is None  # two groups of three packed
    blob = core.to_bytes()
    restored = BrokerCore.from_bytes(blob)
    assert restored.to_bytes() == blob and restored.audit() == core.audit()
    a, b = core.pull_batch(2.0, max_samples=4), restored.pull_batch(2.0, max_samples=4)
    assert a is not None and a == b and restored.to_bytes() == core.to_bytes()


def test_an_early_termination_aborts_every_lease_once():
    """Every lease in flight gets one abort; a later reason to abort one (a stale version, its
    group retired) sends none again, and a snapshot keeps them all aborting."""
    core = make(batch_groups=1, group_size=2, over_provision=3.0, staleness_bound=0)
    admit(core, 3)
    grants = core.lease("gen", 100, 0.0)
    first = [g for g in grants if g.group_id == grants[0].group_id]
    others = [g for g in grants if g.group_id != grants[0].group_id]
    core.chunk(others[0].lease_id, 0, [5], [-1.0], [[0, 1]], 0.5)
    finish(core, first[0])
    effects = finish(core, first[1])
    assert effects == [AbortLease("gen", g.lease_id) for g in others]
    restored = BrokerCore.from_bytes(core.to_bytes())
    for c in (core, restored):
        assert all(c._aborting(c.leases[g.lease_id]) for g in others)
        assert c.publish_version(1, 1.0) == []  # over η, but told to abort already
        assert c.retire_group(others[0].group_id, "test") == []


def test_an_acknowledged_batch_is_let_go_one_group_per_accepted_chunk():
    """An acknowledged batch is not freed all at once (glibc's malloc sorts every chunk freed
    together inside one later allocation, 30-240 ms at 1,000 generators): one group goes per chunk
    accepted afterwards, and a batch the caller still holds is left whole."""
    core = make(mode="async", batch_groups=2, group_size=2)
    _ready_groups(core, 2)
    batch = core.pull_batch(1.0)
    assert core.ack_batches(batch.batch_id) and not core.unacked_batches
    assert list(core._letting_go) == batch.groups
    admit(core, 1, start=100)
    grants = core.lease("gen", 2, 1.0)
    finish(core, grants[0])
    assert list(core._letting_go) == batch.groups[1:]
    finish(core, grants[1])
    assert not core._letting_go
    assert [list(s.tokens) for g in batch.groups for s in g.samples] == [[7, 7]] * 4


def test_a_full_step_with_a_partial_group_leases_it_though_an_older_partial_waits_outside():
    """A chaos run stalled here: its rollout step full of groups whose generator was killed (partial,
    none leased), and at the front of the queue the partial of a group that had left the step at
    the boundary (it held no lease then). That one may not start while the step is full; the
    step's own partials may, oldest first, and no fresh sample while any partial waits. The step is
    set as such a boundary leaves it (``_open_next_step`` keeps the groups leased then)."""
    core = make(batch_groups=1, group_size=1, over_provision=2.0)  # two groups a step
    outside, first, second, _ = admit(core, 4)
    grants = core.lease("gen-a", 5, 0.0)
    assert [core.samples[g.sample_id].group_id for g in grants] == [outside, first]  # the step is full
    for g in grants:
        core.chunk(g.lease_id, 0, [4], [-1.0], [[0, 1]], 0.5)
    core.peer_gone("gen-a", 1.0)  # both back as partials, `outside` first in the queue
    core.step_groups.clear()
    core.step_groups.update({first, second})  # the boundary: `outside` held no lease, `second` did
    got = core.lease("gen-b", 5, 2.0)
    assert [core.samples[g.sample_id].group_id for g in got] == [first]
    assert got[0].resume == [4]
    assert core.samples[core._recycle.first()].group_id == outside  # it waits for room in a step
    assert not any(x.place is Place.LEASED for x in core.samples.values() if x.group_id != first)


def test_a_redelivered_report_of_a_batch_without_a_step_reopens_async_per_step_admission_once():
    """Found by the property run of issue 45: in ``async`` with ``per_step`` admission, the report
    of a batch that made no step reopened the step's count each time it arrived, so a redelivered
    report, after new leases, changed the step's groups (invariant 2)."""
    core = make(mode="async", async_admission="per_step", batch_groups=1, group_size=1,
                over_provision=1.0, staleness_bound=1)
    admit(core, 3)
    g = core.lease("gen", 10, 0.0)[0]
    finish(core, g)
    score_all(core)
    batch = core.pull_batch(1.0)
    core.report_batch(batch.batch_id, 0, [batch.groups[0].group_id], "zero_variance")  # no step: reopened
    assert core.counters.steps_skipped == 1
    core.lease("gen", 10, 2.0)
    before = core.to_bytes()
    core.report_batch(batch.batch_id, 0, [batch.groups[0].group_id], "zero_variance")  # the same, again
    after = core.to_bytes()
    a, b = msgpack.unpackb(before, strict_map_key=False), msgpack.unpackb(after, strict_map_key=False)
    a.pop("counters"), b.pop("counters")  # counters may count the repeat; nothing else may change
    assert a == b and core.counters.steps_skipped == 1
