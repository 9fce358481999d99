"""No silent hangs: a peer frozen with SIGSTOP is noticed, logged and recovered from.

Real processes (broker, a scripted generator, a scorer; this process is the learner). Each kind
of peer is frozen in turn for several peer timeouts: the others must log it (the broker says
``peer_gone ... reason=silent`` for a frozen generator or scorer; a frozen broker makes the
others log ``hub_silent``), and after SIGCONT the run must deliver batches again. At the end the
ledger balances and no sample was delivered twice.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from april_async.testing.cluster import FAST_LINK, Cluster, check_batch_tokens
from april_async.testing.runs import children_of, metrics, up, wait_for, write_config

FREEZE_S = 6 * FAST_LINK["link.peer_timeout_s"]
"""The longest freeze: past every peer timeout of these processes, with room for a loaded machine."""


def test_each_peer_frozen_in_turn_is_logged_and_recovered_from(tmp_path):
    cluster = Cluster(tmp_path)
    ledger = tmp_path / "ledger.json"
    cluster.broker({"mode": "async", "batch_groups": 1, "group_size": 2, "max_response_tokens": 8},
                   extra={"state_file": str(ledger)})
    cluster.generator("gen-0")
    cluster.scorer()
    learner = cluster.learner()
    delivered: list[int] = []

    def batch(timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cluster.assert_alive()
            b = learner.next_batch(0.5)
            if b is not None:
                delivered.extend(check_batch_tokens(b))
                return b
        pytest.fail(f"no batch within {timeout_s:g} s after a freeze\n{cluster.dump_logs()}")

    def logged(name: str, text: str, after: int) -> bool:
        return text in cluster.logs[name].read_text()[after:]

    try:
        batch()
        for frozen, witnesses in [("gen-0", {"broker": "reason=silent"}),
                                  ("scorer-0", {"broker": "reason=silent"}),
                                  ("broker", {"gen-0": "hub_silent", "scorer-0": "hub_silent"})]:
            marks = {w: len(cluster.logs[w].read_text()) for w in witnesses}
            proc = cluster.procs[frozen]
            proc.send_signal(signal.SIGSTOP)
            try:  # frozen until every witness has logged it (or FREEZE_S, far past every peer timeout)
                deadline = time.monotonic() + FREEZE_S
                while time.monotonic() < deadline and not all(logged(w, t, marks[w]) for w, t in witnesses.items()):
                    if (b := learner.next_batch(0.1)) is not None:  # the learner keeps polling (it may reconnect)
                        delivered.extend(check_batch_tokens(b))
            finally:
                proc.send_signal(signal.SIGCONT)
            for witness, text in witnesses.items():
                assert logged(witness, text, marks[witness]), f"{witness} did not notice {frozen} frozen\n" \
                                                              f"{cluster.dump_logs()}"
            for _ in range(2):  # recovered: batches come again
                batch()
    finally:
        learner.close()
        codes = cluster.stop_all()
    assert all(c == 0 for c in codes.values()), (codes, cluster.dump_logs())
    assert len(delivered) == len(set(delivered)), "a sample was delivered twice"
    state = json.loads(ledger.read_text())
    assert state["balanced"] and state["places"]["delivered"] == len(delivered), state["places"]


@pytest.mark.slow
def test_the_learner_and_the_broadcaster_frozen_in_a_whole_run_are_noticed_and_recovered_from(tmp_path):
    """An ``april up`` run (a frozen child does not exit, so the supervisor goes on): the learner
    frozen makes the broker log it silent, the broadcaster frozen makes the broker and both
    generators log it; after SIGCONT the learner takes steps again, each within 45 s — less than
    the broadcaster's collective timeout (60 s), which a round would otherwise wait out for
    generators that re-opened their sessions during the freeze, then bench them for two more."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir)
    log = tmp_path / "up.log"
    proc = up(config, "--set", "run.max_steps=100000", log=log)
    logs = run_dir / "logs"

    def pid_of(name: str) -> int:
        for pid in children_of(run_dir):
            if f"config/{name}.json" in open(f"/proc/{pid}/cmdline").read().replace("\0", " "):
                return pid
        pytest.fail(f"no process for {name}")

    try:
        wait_for("a learner step", lambda: len(metrics(run_dir)) >= 1, 240, proc, log)
        for frozen, witnesses in [("learner-0", {"broker": "peer=learner-0 reason=silent"}),
                                  ("broadcaster", {"broker": "peer=broadcaster reason=silent",
                                                   "gen-0": "hub_silent", "gen-1": "hub_silent"})]:
            marks = {w: len((logs / f"{w}.log").read_text()) for w in witnesses}
            pid = pid_of(frozen)
            os.kill(pid, signal.SIGSTOP)
            try:  # frozen until the witnesses log it, at most well past the run's peer timeout (3 s)
                deadline = time.monotonic() + 12.0
                while time.monotonic() < deadline and not all(
                        text in (logs / f"{w}.log").read_text()[marks[w]:] for w, text in witnesses.items()):
                    time.sleep(0.1)
            finally:
                os.kill(pid, signal.SIGCONT)
            for w, text in witnesses.items():
                assert text in (logs / f"{w}.log").read_text()[marks[w]:], f"{w} did not notice {frozen} frozen"
            for _ in range(3):
                steps = len(metrics(run_dir))
                wait_for(f"a learner step after {frozen} thawed", lambda: len(metrics(run_dir)) > steps, 45, proc,
                         log)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        ledger = json.loads((run_dir / "broker_state.json").read_text())
        assert ledger["balanced"], ledger
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children_of(run_dir):
            os.kill(pid, signal.SIGKILL)
