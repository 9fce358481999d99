"""``april up``'s restart policy, with real child processes that stand in for actors."""

from __future__ import annotations

import json
import sys
import time

from april_async.up import Child, RunConfig, Supervisor


def child(tmp_path, name: str, kind: str, code: str) -> Child:
    return Child(name, kind, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def supervisor(tmp_path, children, **run) -> Supervisor:
    sup = Supervisor(RunConfig(dir=tmp_path, console=False, **run), children, {c.name: {} for c in children}, {})
    sup.start()
    return sup


def settle(sup: Supervisor, until, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        sup._check_children()
        time.sleep(0.05)


def test_a_killed_child_is_restarted_and_children_json_follows_it(tmp_path):
    victim = child(tmp_path, "scorer-0", "scorer", "import time; time.sleep(60)")
    sup = supervisor(tmp_path, [victim], restart="on-failure", restart_delay_s=0.0)
    try:
        first = victim.proc.pid
        victim.proc.kill()
        settle(sup, lambda: victim.proc.pid != first and victim.due_at is None)
        assert victim.proc.pid != first and victim.proc.poll() is None and sup.stop_reason is None
        rows = json.loads((tmp_path / "children.json").read_text())
        assert rows["scorer-0"] == {"kind": "scorer", "pid": victim.proc.pid, "restarts": 1, "log": str(victim.log)}
    finally:
        sup.stop()
    assert victim.proc.poll() is not None


def test_exit_code_2_a_clean_exit_and_too_many_restarts_stop_the_run(tmp_path):
    for code, want in [("raise SystemExit(2)", "configuration error"), ("pass", "stopped on its own"),
                       ("raise SystemExit(3)", "restarts within")]:
        c = child(tmp_path, "gen-0", "generator", code)
        sup = supervisor(tmp_path, [c], restart="on-failure", restart_delay_s=0.0, max_restarts=2)
        try:
            settle(sup, lambda: sup.stop_reason is not None)
        finally:
            sup.stop()
        assert want in sup.stop_reason, sup.stop_reason
        assert len(c.restarts) == (2 if "restarts" in want else 0)


def test_a_crash_loop_backs_off_doubling(tmp_path):
    c = child(tmp_path, "broker", "broker", "raise SystemExit(1)")
    sup = supervisor(tmp_path, [c], restart="on-failure", restart_delay_s=0.1, max_restarts=4)
    delays = []
    try:
        while sup.stop_reason is None:
            before = len(c.restarts)
            settle(sup, lambda: len(c.restarts) > before or sup.stop_reason is not None)
            if len(c.restarts) > before:
                delays.append(c.delay_s)
    finally:
        sup.stop()
    assert delays == [0.1, 0.2, 0.4, 0.8], delays


def test_the_default_policy_stops_the_run_when_a_child_dies(tmp_path):
    c = child(tmp_path, "broker", "broker", "raise SystemExit(1)")
    sup = supervisor(tmp_path, [c])
    try:
        settle(sup, lambda: sup.stop_reason is not None)
    finally:
        sup.stop()
    assert sup.stop_reason == "broker exited with code 1" and not c.restarts
