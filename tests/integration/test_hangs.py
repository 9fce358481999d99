"""No silent hangs: a peer frozen with SIGSTOP is noticed, logged and recovered from.

Real processes (broker, a scripted generator, a scorer; this process is the learner). Each kind
of peer is frozen in turn for several peer timeouts: the others must log it (the broker says
``peer_gone ... reason=silent`` for a frozen generator or scorer; a frozen broker makes the
others log ``hub_silent``), and after SIGCONT the run must deliver batches again. At the end the
ledger balances and no sample was delivered twice.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.integration.harness import FAST_LINK, Cluster, check_batch_tokens

FREEZE_S = 4 * FAST_LINK["link.peer_timeout_s"]


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
            try:
                deadline = time.monotonic() + FREEZE_S
                while time.monotonic() < deadline:  # the learner keeps polling (a frozen broker: it reconnects)
                    if (b := learner.next_batch(0.1)) is not None:
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
