"""``april up`` with the learner as two ranks (FSDP2 over gloo): the whole loop, through a ``kill -9``
of a rank mid-run, in one run. Real processes on loopback, the tiny run of ``april_async/testing/runs.py``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from april_async.testing.runs import (
    ETA,
    children_of,
    logs_of,
    metrics,
    tiny_policy,
    up,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    return tiny_policy(tmp_path_factory.mktemp("policy") / "init", num_layers=2)  # two layers: FSDP shards each


def children(run_dir: Path) -> dict:
    return json.loads((run_dir / "children.json").read_text())


MAX_STEPS = 8
"""The run's end: at least 4 learner steps after rank 1 is killed (at step 2 or 3; a tiny step is well
under a second, and the kill follows the second step's row within the 0.1 s poll), so the restarted
group trains on and then ends the run itself, as a run of two ranks that nobody killed does."""


def test_two_learner_ranks_run_the_whole_loop_through_a_kill_9_of_rank_1(tmp_path, policy):
    """One run covers both: ``kill -9`` of rank 1 mid-run restarts the learner group alone, which
    resumes from its checkpoint and rolls forward; then the run ends at ``run.max_steps`` (the
    learner finished) and is checked as any finished run: every child exited 0, the ledger
    balanced, the staleness bound held, the generators hold the last version, and each rank wrote
    its shards of the last checkpoint."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    log = tmp_path / "up.log"
    proc = up(config, "--set", "learner.ranks=2", "--set", 'run.restart="on-failure"', "--set",
              f"run.max_steps={MAX_STEPS}", "--set", "run.duration_s=400", "--set", "run.restart_delay_s=0.5", log=log)
    try:
        wait_for("two learner steps", lambda: len(metrics(run_dir)) >= 2, 180, proc, log)
        before = children(run_dir)
        steps_before = metrics(run_dir)[-1]["step"]
        rows_before = len(metrics(run_dir))
        assert steps_before <= MAX_STEPS - 4, f"the run was at step {steps_before} when rank 1 was to be killed"
        os.kill(before["learner-0-r1"]["pid"], signal.SIGKILL)
        wait_for("the learner group's restart",
                 lambda: children(run_dir)["learner-0"]["restarts"] == 1
                 and children(run_dir)["learner-0-r1"]["pid"] not in (None, before["learner-0-r1"]["pid"])
                 and children(run_dir)["learner-0"]["pid"] not in (None, before["learner-0"]["pid"]), 60, proc, log)
        after = children(run_dir)
        for name in ("broker", "broadcaster", "scorer-0", "gen-0", "gen-1"):
            assert after[name]["restarts"] == 0 and after[name]["pid"] == before[name]["pid"], (name, after)
        rc = proc.wait(timeout=300)
        out = log.read_text()
        assert rc == 0, f"april up exited {rc}\n{out}\n{logs_of(run_dir)}"
        assert "learner group" in out and "restarts" in out, out[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stop"] == "learner finished" and summary["steps"] == MAX_STEPS, summary
        assert summary["exit_codes"].get("learner-0-r1") == 0 and set(summary["exit_codes"].values()) == {0}, summary
        rank1 = (run_dir / "logs" / "learner-0-r1.log").read_text()
        assert "rank_ready" in rank1 and "rank_stopped" in rank1, rank1[-2000:]

        rows = metrics(run_dir)
        assert rows[-1]["step"] >= steps_before + 3, (steps_before, rows[-1])
        issued_before = max(r["version"] for r in rows[:rows_before])
        after_restart = [r["version"] for r in rows[rows_before:]]
        # No version is reused: the restarted group resumed from its checkpoint and rolled forward.
        assert after_restart and min(after_restart) > issued_before, (issued_before, after_restart)
        assert max(r["lag_max"] for r in rows) <= ETA
        final = rows[-1]["version"]
        ledger = json.loads((run_dir / "broker_state.json").read_text())
        assert ledger["balanced"] and ledger["expected"] > 0, ledger
        status = json.loads((run_dir / "broadcaster.json").read_text())
        assert status["version"] == final and status["failed_rounds"] == 0, status
        assert all(v == final for v in status["members"].values()), status  # versions reached the generators
        newest = max((run_dir / "checkpoints").glob("v*"))
        assert len(list((newest / "sharded").glob("*.distcp"))) == 2  # each rank wrote its shards
        assert not children_of(run_dir), "actors outlived april up"
    finally:
        if proc.poll() is None:
            proc.kill()
        time.sleep(0.2)
        for pid in children_of(run_dir):
            os.kill(pid, signal.SIGKILL)
