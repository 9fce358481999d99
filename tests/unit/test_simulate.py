"""The main job so far: ``april simulate`` runs the real broker core in every mode."""

from april_async.broker.config import RolloutConfig
from april_async.cli import main
from april_async.sim.engine import Simulation, SimSpec

SPEC = SimSpec(generators=2, slots=8, batches=4, median_len=24, train_s=0.05)


def run(mode, **kw):
    cfg = RolloutConfig(mode=mode, batch_groups=4, group_size=2, max_response_tokens=128, **kw)
    return Simulation(cfg, SPEC).run()


def test_every_mode_delivers_its_batches_and_the_ledger_balances():
    for mode, kw in [("sync", dict(over_provision=1.0, staleness_bound=0)), ("april", {}), ("async", {})]:
        r = run(mode, **kw)
        c = r.counters
        assert r.batches == SPEC.batches and c["groups_delivered"] == 4 * SPEC.batches
        assert c["samples_delivered"] == 2 * c["groups_delivered"]
        assert 0 < r.busy_fraction <= 1


def test_april_recycles_partials_and_sync_never_does():
    assert run("sync", over_provision=1.0, staleness_bound=0).counters["partials_recycled"] == 0
    april = run("april", over_provision=2.0, staleness_bound=2).counters
    assert april["early_terminations"] > 0 and april["partials_recycled"] > 0


def test_cli_prints_one_row_per_mode(capsys):
    assert main(["simulate", "--batches", "2", "--slots", "8", "--median-len", "16"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert [r.split()[0] for r in rows] == ["mode", "sync", "april", "async"]


def test_cli_refuses_a_bad_knob_naming_it(capsys):
    assert main(["simulate", "--modes", "april", "--r", "0.5"]) == 2
    assert "over_provision" in capsys.readouterr().err
