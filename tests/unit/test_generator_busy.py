"""The generators' busy time: the clock the actor keeps, and the experiment's reading of its log lines."""

import json

import pytest

from april_async.experiments.numbers import generator_shares
from april_async.generator.actor import BusyClock


def test_busy_time_counts_each_interval_at_the_count_seen_at_its_start():
    c = BusyClock(10.0)
    c.tick(11.0, 2)  # idle until now, two sequences from here
    c.tick(13.0, 1)  # two of them for 2 s
    c.tick(14.0, 0)  # one for 1 s
    c.tick(20.0, 0)  # idle
    assert c.busy_s == pytest.approx(3.0) and c.slot_s == pytest.approx(5.0)


def test_the_experiment_reads_busy_lines_in_the_window_from_either_log_format(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "gen-0.log").write_text(
        "2026-11-25T10:00:00Z [info     ] weights_loaded   actor=generator version=3\n"
        "2026-11-25T10:00:00Z [info     ] busy             actor=generator busy_s=1.0 slot_s=10.0 slots=4 up_s=5 t=100.0\n"
        "2026-11-25T10:00:05Z [info     ] busy             actor=generator busy_s=5.0 slot_s=22.0 slots=4 up_s=10 t=105.0\n"
        "2026-11-25T10:00:10Z [info     ] busy             actor=generator busy_s=9.0 slot_s=30.0 slots=4 up_s=15 t=110.0\n"
        "2026-11-25T10:00:15Z [info     ] busy             actor=generator busy_s=9.0 slot_s=30.0 slots=4 up_s=20 t=115.0\n")
    (logs / "n1-gen-0.log").write_text("\n".join(json.dumps(r) for r in [
        {"event": "busy", "busy_s": 0.0, "slot_s": 0.0, "slots": 2, "t": 100.0},
        {"event": "stopped"},
        {"event": "busy", "busy_s": 10.0, "slot_s": 10.0, "slots": 2, "t": 110.0}]) + "\n")
    shares = generator_shares(tmp_path, 100.0, 110.0)
    # gen-0: 8 s busy of 10, 20 slot-seconds of 40; n1-gen-0: 10 of 10, 10 of 20.
    assert shares["gen_busy_frac"] == pytest.approx((0.8 + 1.0) / 2)
    assert shares["gen_slot_frac"] == pytest.approx((0.5 + 0.5) / 2)
    assert generator_shares(tmp_path, 200.0, 300.0) == {}
