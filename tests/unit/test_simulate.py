"""The simulator: the real broker core around simulated generators that jump from event to event."""

import subprocess
import sys
from pathlib import Path

import pytest

from april_async.broker.config import RolloutConfig
from april_async.cli import main
from april_async.sim.config import SimError, SimSettings, sim_settings
from april_async.sim.simulation import Simulation

ROOT = Path(__file__).resolve().parents[2]
SPEC = SimSettings(generators=3, slots=8, step_a_s=0.01, step_b_s=0.002, prefill_s=1e-4, prompt_tokens=8,
               workload="math", batches=4, warmup=1)
MODES = [("sync", 1.0, 0), ("april", 1.5, 1), ("april", 2.0, 2), ("async", 2.0, 1)]


def cfg(mode, r, eta, **kw):
    knobs = dict(batch_groups=4, group_size=3, max_response_tokens=160) | kw
    return RolloutConfig(mode=mode, over_provision=r, staleness_bound=eta, **knobs)


@pytest.mark.parametrize("mode,r,eta", MODES)
def test_every_mode_delivers_its_batches_and_the_ledger_balances(mode, r, eta):
    sim = Simulation(cfg(mode, r, eta), SPEC)
    res = sim.run()
    c = res.counters
    assert res.ledger_ok
    places = sim.core.place_counts()
    assert sum(places.values()) == 3 * c["groups_admitted"]
    assert places["delivered"] == c["samples_delivered"] and len(sim.core.samples) < sum(places.values())
    assert c["batches_delivered"] == SPEC.warmup + SPEC.batches and res.batches == SPEC.batches
    assert c["groups_delivered"] == 4 * c["batches_delivered"] and c["samples_delivered"] == 3 * c["groups_delivered"]
    assert res.groups == 4 * SPEC.batches and res.useful_tokens > 0 and res.sim_seconds > 0
    # Every token a generator reported is delivered, dropped by a restart or retirement, or still held.
    held = sum(len(s.tokens) for s in sim.core.samples.values())  # the live ones: ended groups left
    assert c["tokens_generated"] == c["tokens_delivered"] + c["tokens_discarded"] + c["tokens_retired"] + held
    assert c["tokens_duplicate"] == c["chunk_gaps"] == c["stale_reports"] == 0  # every report was on time
    assert max(int(lag) for lag in c["staleness_samples"]) <= eta  # nothing delivered past η
    assert 0.0 <= res.idle_fraction <= 1.0 and 0.0 <= res.empty_fraction <= res.idle_fraction + 1e-9
    for call in ("admit", "lease", "finish", "scored", "pull_batch", "publish_version"):
        p50, p99, n = res.latency(call)
        assert n > 0 and 0 < p50 <= p99 <= res.max_us(call), call


def test_the_bounds_line_names_each_call_over_its_bound():
    """Issue 18's bounds: p99 <= 1 ms for a per-message call, max <= 10 ms for any call (pull_batch
    included) and any full garbage collection."""
    from array import array

    from april_async.sim.report import bound_violations, bounds_line

    res = Simulation(cfg("async", 2.0, 1), SPEC).run()
    res.latency_us = {call: array("d", [1.0] * 100) for call in res.latency_us}
    res.gc_pauses_ms, res.gc_cpu_ms = array("d", [2.0]), array("d", [2.0])
    res.slow_calls = {call: [] for call in res.latency_us}
    assert bound_violations(res) == [] and bounds_line([res]).endswith(": PASS")
    res.latency_us["finish"] = array("d", [1.0] * 90 + [2_000.0] * 10)  # p99 2 ms, max 2 ms
    res.latency_us["pull_batch"] = array("d", [1.0] * 90 + [20_000.0] * 10)  # whole batches: max only
    res.slow_calls["pull_batch"] = [(90, 20_000.0, 19_000.0)]  # it worked 19 ms of its 20
    res.latency_us["lease"] = array("d", [1.0] * 999 + [25_000.0])  # p99 1 µs
    res.slow_calls["lease"] = [(999, 25_000.0, 300.0)]  # 25 ms of wall, 0.3 ms of CPU: the OS ran another
    res.gc_pauses_ms, res.gc_cpu_ms = array("d", [30.0]), array("d", [30.0])
    broken = ["full GC 30 ms of CPU", "pull_batch max 19.0 ms of CPU", "finish p99 2.0 ms"]
    assert bound_violations(res) == broken
    assert f"FAIL — async r=2: {', '.join(broken)}" in bounds_line([res])


def test_repeated_runs_make_the_same_calls_and_each_call_keeps_its_least_time():
    """``--repeats``: the simulation is deterministic, so the i-th call of a kind is the same work in
    every run, and the least time over the runs is the call's own (a stall of the machine in one run
    is not in the others). A call over the bound in one run only is not over it in the combined
    result; one over it in every run is, with its lesser time."""
    from array import array

    from april_async.sim.report import bound_violations
    from april_async.sim.simulation import least_of

    a, b = (Simulation(cfg("april", 2.0, 1), SPEC).run() for _ in range(2))
    assert a.counters == b.counters
    assert {c: len(xs) for c, xs in a.latency_us.items()} == {c: len(xs) for c, xs in b.latency_us.items()}
    # The measured times are this machine's and vary (a loaded CI box put lease's p99 over 1 ms once):
    # replace them with known ones, different per run, so that only what is planted below breaks a bound.
    for r, k in ((a, 7), (b, 5)):
        r.latency_us = {call: array("d", (10.0 + (i * k) % 11 for i in range(len(xs))))
                        for call, xs in r.latency_us.items()}
        r.slow_calls = {call: [] for call in r.latency_us}
        r.gc_pauses_ms, r.gc_cpu_ms = array("d", [2.0]), array("d", [2.0])
    n = len(a.latency_us["lease"])
    a.latency_us["lease"][3] = 30_000.0  # a stall in run a only: 30 ms of wall and of CPU
    a.slow_calls["lease"] = [(3, 30_000.0, 30_000.0)]
    for r, ms in ((a, 14), (b, 12)):  # the same slice over the bound in both runs
        r.latency_us["pull_batch"][0] = ms * 1e3
        r.slow_calls["pull_batch"] = [(0, ms * 1e3, ms * 1e3)]
    assert bound_violations(a) == ["lease max 30.0 ms of CPU", "pull_batch max 14.0 ms of CPU"]
    both = least_of([a, b])
    assert both.repeats == 2 and both.counters == a.counters and len(both.latency_us["lease"]) == n
    assert both.latency_us["lease"][3] == b.latency_us["lease"][3] < 30_000.0
    assert all(x == min(p, q) for x, p, q in zip(both.latency_us["finish"], a.latency_us["finish"],
                                                  b.latency_us["finish"]))
    assert both.slow_calls["lease"] == [] and both.slow_calls["pull_batch"] == [(0, 12e3, 12e3)]
    assert bound_violations(both) == ["pull_batch max 12.0 ms of CPU"]
    assert both.row()["repeats"] == 2


def test_runs_that_made_different_calls_are_not_compared_call_by_call():
    a = Simulation(cfg("april", 2.0, 1), SPEC).run()
    b = Simulation(cfg("april", 2.0, 1), SPEC.model_copy(update={"seed": SPEC.seed + 1})).run()
    from april_async.sim.simulation import least_of

    with pytest.raises(SimError, match="different core calls"):
        least_of([a, b])


def test_april_recycles_partials_and_sync_never_does():
    sync = Simulation(cfg("sync", 1.0, 0), SPEC).run()
    april = Simulation(cfg("april", 2.0, 2), SPEC).run()
    assert sync.counters["partials_recycled"] == 0 and sync.counters["early_terminations"] == 0
    assert sync.off_policy_tokens == 0
    assert april.counters["early_terminations"] > 0 and april.counters["partials_recycled"] > 0
    assert april.tokens_per_s > sync.tokens_per_s  # the long tail, recycled


@pytest.mark.parametrize("mode,r,eta,train_s", [("sync", 1.0, 0, 0.0), ("april", 2.0, 0, 0.0),
                                                ("april", 1.5, 2, 0.3), ("async", 2.0, 1, 0.3), ("async", 1.5, 0, 0.0)])
def test_jumps_give_what_a_step_by_step_run_gives(mode, r, eta, train_s):
    """The jump-ahead engine against the reference that visits every decode step and records each
    token's version one at a time: the same core calls, so the same counters — tokens delivered,
    their versions (the staleness histograms), restarts, recycled partials — and the same clock."""
    for workload in ("math", "pareto:min=4,alpha=1.1"):
        spec = SPEC.model_copy(update={"workload": workload, "train_s": train_s})
        jump = Simulation(cfg(mode, r, eta), spec).run()
        step = Simulation(cfg(mode, r, eta), spec.model_copy(update={"step_by_step": True})).run()
        assert jump.counters == step.counters
        assert jump.sim_seconds == pytest.approx(step.sim_seconds, rel=1e-12)
        assert jump.idle_fraction == pytest.approx(step.idle_fraction, abs=1e-9)
        assert sum(len(v) for v in step.latency_us.values()) > 0
        if mode == "async" and train_s:
            assert len(jump.counters["staleness_tokens"]) > 1  # versions changed under running leases


def test_a_constant_workload_takes_exactly_its_decode_steps():
    """sync, every response 50 tokens, one sample per slot: a batch is one prefill and 50 full steps."""
    spec = SimSettings(generators=2, slots=4, step_a_s=0.01, step_b_s=0.001, prefill_s=0.0005, prompt_tokens=6,
                   workload="const:50", batches=3, warmup=1)
    res = Simulation(cfg("sync", 1.0, 0, batch_groups=4, group_size=2), spec).run()
    per_batch = 4 * 6 * 0.0005 + 50 * (0.01 + 4 * 0.001)  # prefill 4 prompts, then 50 steps of 4
    assert res.sim_seconds == pytest.approx(3 * per_batch)
    assert res.useful_tokens == 3 * 8 * 50 and res.idle_fraction == pytest.approx(0.0, abs=1e-9)


def test_bad_spec_and_impossible_cluster_are_refused_naming_the_setting():
    with pytest.raises(SimError, match="slots"):
        sim_settings({**SPEC.model_dump(), "slots": 0})
    with pytest.raises(SimError, match="train_s"):
        sim_settings({**SPEC.model_dump(), "train_s": -1})
    with pytest.raises(SimError, match="step_a_s"):
        sim_settings({"step_a_s": 0, "step_b_s": 0})
    with pytest.raises(SimError, match="cannot hold a group"):
        Simulation(cfg("sync", 1.0, 0, group_size=30), SPEC)


def test_cli_prints_one_row_per_mode(capsys):
    assert main(["simulate", "--smoke"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("mode "))
    rows = [ln.split() for ln in lines[head + 1:head + 5]]
    assert [(r[0], float(r[1])) for r in rows] == [("sync", 1.0), ("april", 1.5), ("april", 2.0), ("async", 2.0)]
    assert rows[0][6] == "1.00x" and all(float(r[5]) > 0 for r in rows)
    assert "april (r=2) / sync = " in out and "p50 / p99" in out and "slowest call" in out
    assert "bounds (p99 <= 1 ms a message call, max <= 10 ms of CPU any call or full GC): " in out


def test_tools_simulate_runs_from_a_checkout_and_writes_json(tmp_path):
    out = subprocess.run([sys.executable, "tools/simulate.py", "--smoke", "--modes", "sync,april:2",
                          "--repeats", "2", "--json", str(tmp_path / "s.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "each call the least of 2 runs" in out.stdout and out.stdout.count("  april r=2: ") == 2
    assert "machine: the same " in out.stdout
    import json

    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["mode"], r["r"]) for r in rows] == [("sync", 1.0), ("april", 2.0)]
    assert rows[0]["vs_base"] == 1.0 and all(r["ledger_ok"] and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["repeats"] == 2 for r in rows)


@pytest.mark.parametrize("argv,named", [
    (["--modes", "april:0.5"], "over_provision"),
    (["--modes", "april,turbo"], "unknown mode 'turbo'"),
    (["--modes", "sync:2"], "over_provision = 1"),
    (["--eta", "-1"], "--eta"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--generators", "0"], "generators"),
    (["--step-a", "-0.1"], "step_a_s"),
    (["--workload", "zipf:a=2"], "unknown kind 'zipf'"),
])
def test_cli_refuses_a_bad_knob_in_one_line_naming_it(capsys, argv, named):
    assert main(["simulate", "--generators", "2", "--slots", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
