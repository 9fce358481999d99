"""``april up`` with the learner as two ranks (FSDP2 over gloo): the whole loop, and ``kill -9`` of a
rank mid-run. Real processes on loopback, the tiny run of ``april_async/testing/runs.py``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from april_async.testing.runs import (
    ETA,
    STEPS,
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


def test_april_up_with_two_learner_ranks_runs_the_whole_loop(tmp_path, policy):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    log = tmp_path / "up.log"
    proc = up(config, "--set", "learner.ranks=2", log=log)
    try:
        rc = proc.wait(timeout=300)
        out = log.read_text()
        assert rc == 0, f"april up exited {rc}\n{out}\n{logs_of(run_dir)}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stop"] == "learner finished" and summary["steps"] == STEPS, summary
        assert summary["exit_codes"].get("learner-0-r1") == 0 and set(summary["exit_codes"].values()) == {0}, summary
        rank1 = (run_dir / "logs" / "learner-0-r1.log").read_text()
        assert "rank_ready" in rank1 and "rank_stopped" in rank1, rank1[-2000:]
        rows = metrics(run_dir)
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


def test_kill_9_of_learner_rank_1_restarts_the_group_and_training_goes_on(tmp_path, policy):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    log = tmp_path / "up.log"
    proc = up(config, "--set", "learner.ranks=2", "--set", 'run.restart="on-failure"', "--set", "run.max_steps=100000",
              "--set", "run.duration_s=400", "--set", "run.restart_delay_s=0.5", log=log)
    try:
        wait_for("two learner steps", lambda: len(metrics(run_dir)) >= 2, 180, proc, log)
        before = children(run_dir)
        steps_before = metrics(run_dir)[-1]["step"]
        rows_before = len(metrics(run_dir))
        os.kill(before["learner-0-r1"]["pid"], signal.SIGKILL)
        wait_for("the learner group's restart",
                 lambda: children(run_dir)["learner-0"]["restarts"] == 1
                 and children(run_dir)["learner-0-r1"]["pid"] not in (None, before["learner-0-r1"]["pid"])
                 and children(run_dir)["learner-0"]["pid"] not in (None, before["learner-0"]["pid"]), 60, proc, log)
        wait_for("three steps after the restart",
                 lambda: metrics(run_dir) and metrics(run_dir)[-1]["step"] >= steps_before + 3, 240, proc, log)
        after = children(run_dir)
        for name in ("broker", "broadcaster", "scorer-0", "gen-0", "gen-1"):
            assert after[name]["restarts"] == 0 and after[name]["pid"] == before[name]["pid"], (name, after)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        out = log.read_text()
        assert "learner group" in out and "restarts" in out, out[-3000:]
        ledger = json.loads((run_dir / "broker_state.json").read_text())
        assert ledger["balanced"], ledger
        rows = metrics(run_dir)
        issued_before = max(r["version"] for r in rows[:rows_before])
        after_restart = [r["version"] for r in rows[rows_before:]]
        # No version is reused: the restarted group resumed from its checkpoint and rolled forward.
        assert after_restart and min(after_restart) > issued_before, (issued_before, after_restart)
        assert not children_of(run_dir), "actors outlived april up"
    finally:
        if proc.poll() is None:
            proc.kill()
        time.sleep(0.2)
        for pid in children_of(run_dir):
            os.kill(pid, signal.SIGKILL)
