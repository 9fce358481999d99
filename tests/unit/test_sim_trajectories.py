"""The simulator with trajectories (``--turns K``): each sample is K policy turns, every turn but the
last answered by a tool's observation through the core's ``observed``, the last by a reward."""

import pytest

from april_async.cli import main
from april_async.sim.config import SimError, SimSettings, sim_settings
from april_async.sim.simulation import Simulation

K = 4
SPEC = SimSettings(generators=8, slots=8, group_size=4, max_response_tokens=512, prompt_tokens=8, batches=2,
                   warmup=1, turns=K, tool_s=0.2)
# sync, april and async with η = 4 (nothing breaks it); with η = 1, and with η = 0 and a slow learner,
# trajectories waiting on a tool or a lease break η and are demoted (their turns become context).
MODES = [("sync", 1.0, 0, 0.0), ("april", 2.0, 4, 0.0), ("async", 2.0, 4, 0.0), ("april", 2.0, 1, 0.0),
         ("async", 2.0, 1, 0.0), ("april", 2.0, 0, 0.5), ("async", 2.0, 0, 1.0)]


def run(mode, r, eta, train_s, **kw):
    """One run, with every delivered sample kept (the simulation lets its batches go at once)."""
    spec = SPEC.model_copy(update={"train_s": train_s, **kw})
    sim = Simulation(spec.rollout(mode, r, eta), spec)
    delivered = []
    pull = sim.core.pull_batch

    def keep(*args):
        batch = pull(*args)
        if batch is not None:
            delivered.extend(s for g in batch.groups for s in g.samples)
        return batch

    sim.core.pull_batch = keep
    return sim, sim.run(), delivered


@pytest.mark.parametrize("mode,r,eta,train_s", MODES)
def test_every_delivered_sample_has_its_turns_and_the_ledger_balances(mode, r, eta, train_s):
    sim, res, delivered = run(mode, r, eta, train_s)
    c, core = res.counters, sim.core
    assert res.ledger_ok and core.audit()["balanced"]
    # Conservation with observations: every token generated or observed is held, delivered,
    # discarded or retired; nothing was restarted or retired (a trajectory over η is demoted).
    held = sum(s.n_tokens for s in core.samples.values())
    assert (c["tokens_generated"] + c["tokens_observed"]
            == held + c["tokens_delivered"] + c["tokens_discarded"] + c["tokens_retired"])
    assert c["restarts"] == c["tokens_discarded"] == c["tokens_retired"] == 0 and not c["groups_retired"]
    assert c["batches_delivered"] == SPEC.warmup + SPEC.batches and len(delivered) == c["samples_delivered"]
    # Every delivered sample ran its K turns (no turn runs into the budget at the turn budget the
    # settings give: K turns and K - 1 of the longest observations fit).
    assert res.turn_counts == {K: len(delivered)} and res.turns_per_sample == K
    assert all(s.finish_reason == "stop" and len(s.tokens) < 512 for s in delivered)
    # Every turn that ended was answered (an observation, or the last turn's reward) or is still
    # at its tool; the observations and their tokens were counted.
    assert c["turns_finished"] == c["observations"] + c["scores_ok"] + core.place_counts()["stepping"]
    assert c["scores_ok"] >= len(delivered) and c["observations"] >= (K - 1) * len(delivered)
    lo, hi = SPEC.observation_min, SPEC.observation_max
    assert lo * c["observations"] <= c["tokens_observed"] <= hi * c["observations"]
    assert 0 < res.observations <= c["observations"] and res.observation_tokens > 0
    # The observed call is timed as its own kind, once per observation, and held to the bounds.
    p50, p99, n = res.latency("observed")
    assert n == c["observations"] and 0 < p50 <= p99 <= res.max_us("observed")
    assert res.row()["observed_calls"] == n and res.row()["turns_per_sample"] == K
    if c["turns_demoted"]:
        assert eta < 4
        return
    # Without demotions a sample's context is exactly its observations: K - 1 spans, of the lengths
    # the tool drew, after turns of the lengths the workload drew (so every resumed turn went on
    # from where the last one and its observation ended).
    for s in delivered:
        pos, want = 0, []
        for k in range(K):
            pos += sim._turn_length(s.sample_id, k)
            if k < K - 1:
                n = sim._observation_tokens(s.sample_id, k)
                want.append((pos, n))
                pos += n
        assert list(s.context) == want and len(s.tokens) == pos


def test_demotions_happen_where_eta_is_tight():
    """The η <= 1 runs above do cover demoted trajectories."""
    assert all(run(*m)[1].counters["turns_demoted"] > 0 for m in MODES if m[2] <= 1 and m[0] != "sync")


@pytest.mark.parametrize("mode,r,eta,train_s", [("april", 2.0, 1, 0.0), ("async", 2.0, 0, 1.0)])
def test_jumps_give_what_a_step_by_step_run_gives(mode, r, eta, train_s):
    """Tools' answers are events like any: the jumping engine and the step-by-step reference make
    the same core calls at the same times."""
    jump = run(mode, r, eta, train_s)[1]
    step = run(mode, r, eta, train_s, step_by_step=True)[1]
    assert jump.counters == step.counters and jump.turn_counts == step.turn_counts
    assert jump.sim_seconds == pytest.approx(step.sim_seconds, rel=1e-12)


def test_tools_at_once_and_single_turn_samples():
    """tool_s = 0 answers each observation in the call that scores the turn; turns = 0 is the
    single-turn simulator, with no observed call."""
    res = run("april", 2.0, 1, 0.0, tool_s=0.0)[1]
    assert res.ledger_ok and res.turn_counts == {K: res.counters["samples_delivered"]}
    single = run("april", 2.0, 1, 0.0, turns=0)[1]
    assert single.counters["observations"] == single.latency("observed")[2] == 0
    assert single.counters["turns_finished"] == 0 and single.turn_counts == {}


def test_settings_that_leave_no_room_for_a_turn_are_refused():
    spec = sim_settings({**SPEC.model_dump(), "turns": 10, "max_response_tokens": 512})
    with pytest.raises(SimError, match="no room for a turn"):
        spec.rollout("april", 2.0, 1)
    with pytest.raises(SimError, match="observation_min"):
        sim_settings({**SPEC.model_dump(), "observation_min": 80})
    with pytest.raises(SimError, match="environments"):
        Simulation(SPEC.model_copy(update={"turns": 0}).rollout("april", 2.0, 1), SPEC)


def test_cli_reports_turns_and_the_observed_call(capsys):
    assert main(["simulate", "--smoke", "--turns", "3", "--modes", "sync,april:2"]) == 0
    out = capsys.readouterr().out
    assert "trajectories: 3 turns each" in out and "turns/sample" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("sync ", "april "))]
    assert any(r[-2] == "3.00" and r[-1].startswith("3:") for r in rows)  # the trajectory table
    heads = [ln.split() for ln in out.splitlines() if ln.startswith("mode ") and "publish_version" in ln]
    assert len(heads) == 3 and all("observed" in h for h in heads)  # p50 / p99, the slowest, their CPU
    assert "bounds (p99 <= 1 ms a message call" in out
