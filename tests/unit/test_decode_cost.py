"""``experiments/decode_cost.py`` (``tools/abort_cost.py``) on a synthetic run: leases assigned to the
learner step they ended in, the decoding spent off the step's batch, and the wait removed against
sync, seed by seed."""

from __future__ import annotations

import json

import pytest

from april_async.experiments.decode_cost import experiment_runs, lease_lines, run_cost, table


def write_run(d, steps, leases, batches, generators=2):
    """``steps``: (step, end time, wait_s, batch_id); ``leases``: (generator, sample, reason, decode_s, t)."""
    (d / "logs").mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": t, "wait_s": w, "batch_id": b})
                                             + "\n" for s, t, w, b in steps))
    (d / "batches.jsonl").write_text("".join(json.dumps({"batch_id": b,
                                                         "samples": [[sid, 0, 0] for sid in sids]})
                                             + "\n" for b, sids in batches.items()))
    for g in range(generators):
        lines = []
        for gen, sample, reason, decode_s, t in leases:
            if gen == g:  # the console form for one generator, JSON lines for the other
                fields = dict(event="lease_done", lease=sample, sample=sample, group=0, reason=reason,
                              tokens=5, decode_s=decode_s, t=t)
                lines.append(json.dumps(fields) if g else
                             "2026 [info ] lease_done "
                             + " ".join(f"{k}={v}" for k, v in fields.items() if k != "event"))
        (d / "logs" / f"n1-gen-{g}.log").write_text("\n".join(lines + ["something else busy_s=1"]) + "\n")


def test_leases_fall_in_the_step_they_ended_in_and_off_batch_time_is_counted(tmp_path):
    run = tmp_path / "april"
    write_run(run, steps=[(1, 10.0, 9.0, 0), (2, 20.0, 4.0, 1)],
              leases=[(0, 1, "stop", 2.0, 5.0), (1, 2, "stop", 3.0, 6.0),  # step 1, in its batch
                      (0, 3, "abort", 1.5, 10.5), (1, 4, "stop", 0.5, 12.0),  # step 2: 3 aborted, 4 finished
                                                                              # late
                      (0, 5, "stop", 2.5, 15.0), (1, 6, "stop", 9.0, 25.0)],  # 6 ends after the last step
              batches={0: [1, 2], 1: [5]})
    assert [r["sample"] for r in lease_lines(run / "logs" / "n1-gen-0.log")] == [1, 3, 5]
    cost = run_cost(run)
    one, two = cost.steps
    assert (one.leases, one.decoded_s, one.off_batch_s) == (2, 5.0, 0.0)
    assert (two.leases, two.decoded_s, two.off_batch_s, two.aborted_s) == (3, 4.5, 2.0, 1.5)
    assert cost.generators == 2 and cost.mean("wait_s") == 4.0  # the first step (start-up) left out


def test_an_experiments_runs_give_the_wait_removed_against_sync_seed_by_seed(tmp_path):
    for cell, wait in (("sync", 8.0), ("april-r2-eta4", 5.0)):
        write_run(tmp_path / "cells" / cell / "seed0", steps=[(1, 10.0, 20.0, 0), (2, 20.0, wait, 1)],
                  leases=[(0, 1, "stop", 2.0, 15.0), (1, 2, "abort", 1.0, 16.0)], batches={1: [1]})
    costs = {key: run_cost(d) for key, d in experiment_runs(tmp_path).items()}
    assert sorted(costs) == [("april-r2-eta4", 0), ("sync", 0)]
    text = table(costs)
    assert "| april-r2-eta4 | 0 | 2 | 5.00 | 3.00 | 1.00 | 33 % | 0.50 | 3.00 |" in text
    assert "| april-r2-eta4 | 1 | 5.00 | 0.50 | 3.00 |" in text  # per cell: the bet's two sides


def test_a_run_without_lease_lines_says_how_to_make_them(tmp_path):
    write_run(tmp_path / "r", steps=[(1, 1.0, 0.5, 0)], leases=[], batches={})
    with pytest.raises(ValueError, match="generator.log_leases=true"):
        run_cost(tmp_path / "r")
