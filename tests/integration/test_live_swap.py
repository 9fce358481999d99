"""Live swaps: replace one component while the rest runs, with nothing lost.

Real actor processes on loopback; this process is the learner. Each test swaps one component —
the scorer for one with another reward plug-in, a generator for one on another engine, and
generators added and removed — while batches keep coming, then checks:
- every delivered token is right (scripted engine) or at least was delivered once;
- no sample was delivered twice;
- the broker's ledger balances when it stops (every admitted sample delivered, retired with a
  counted reason, or still buffered).
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from april_async.model.decoder import CausalLM
from april_async.testing.cluster import Cluster, check_batch_tokens

ROLLOUT = {"mode": "async", "batch_groups": 1, "group_size": 2, "max_response_tokens": 8, "staleness_bound": 4}


class Run:
    """A broker with a ledger file, and this process as the learner."""

    def __init__(self, tmp_path):
        self.cluster = Cluster(tmp_path)
        self.ledger = tmp_path / "ledger.json"
        self.cluster.broker(ROLLOUT, extra={"state_file": str(self.ledger), "prompts.length": 5})
        self.learner = None
        self.samples: list[int] = []
        self.batches = []

    def remove(self, name: str, sig) -> None:
        """Stop an actor for good (it is swapped out: its exit is expected)."""
        self.cluster.kill(name, sig)
        self.cluster.procs.pop(name)

    def start_learner(self):
        self.learner = self.cluster.learner()

    def batch(self, timeout_s: float = 60.0, check_tokens: bool = True):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.cluster.assert_alive()
            b = self.learner.next_batch(1.0)
            if b is None:
                continue
            ids = [s.sample_id for g in b.groups for s in g.samples]
            if check_tokens:
                check_batch_tokens(b)
            self.samples += ids
            self.batches.append(b)
            return b
        pytest.fail(f"no batch within {timeout_s:g} s\n{self.cluster.dump_logs()}")

    def finish(self) -> dict:
        """Stop everything; the ledger, checked: balanced, and no sample delivered twice."""
        self.learner.close()
        codes = self.cluster.stop_all()
        assert all(c == 0 for c in codes.values()), (codes, self.cluster.dump_logs())
        assert len(self.samples) == len(set(self.samples)), "a sample was delivered twice"
        ledger = json.loads(self.ledger.read_text())
        assert ledger["balanced"], ledger
        assert ledger["places"]["delivered"] == len(self.samples), (ledger["places"], len(self.samples))
        return ledger


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_the_scorer_is_replaced_by_one_with_another_reward(tmp_path, stop):
    run = Run(tmp_path)
    run.cluster.generator("gen-0")
    run.cluster.scorer("scorer-0")
    run.start_learner()
    before = [s.reward for g in run.batch().groups for s in g.samples]
    assert set(before) <= {0.0, 1.0}  # the scripted task's built-in reward (parity)
    run.remove("scorer-0", stop)
    run.cluster.scorer("scorer-1", **{"rewards.scripted": "april_async.testing.rewards:minus_one"})
    for _ in range(20):  # samples scored before the swap may still be in flight; then only the new reward
        rewards = [s.reward for g in run.batch().groups for s in g.samples]
        if set(rewards) == {-1.0}:
            break
    else:
        pytest.fail(f"the new reward never showed\n{run.cluster.dump_logs()}")
    run.finish()


def test_generators_are_added_removed_and_replaced_by_another_engine(tmp_path):
    from april_async.testing.models import TINY

    torch.manual_seed(0)
    CausalLM(TINY).save_pretrained(tmp_path / "ckpt")
    run = Run(tmp_path)
    run.cluster.generator("gen-a", slots=4)
    run.cluster.scorer()
    run.start_learner()
    run.batch()
    run.cluster.generator("gen-b", slots=2, lengths=[6, 7])  # added: another engine config
    run.batch()
    run.remove("gen-a", signal.SIGKILL)  # removed hard: its leases are reclaimed
    for _ in range(3):
        run.batch()
    run.remove("gen-b", signal.SIGTERM)  # removed cleanly (bye)
    run.cluster.generator("gen-t", engine="torch", checkpoint=str(tmp_path / "ckpt"), slots=4, max_seq_len=64)
    for _ in range(20):  # until a batch the embedded engine made (buffered ones may come first)
        b = run.batch(check_tokens=False)
        try:
            check_batch_tokens(b)
        except AssertionError:  # not the scripted engine's tokens: the torch generator's
            break
    else:
        pytest.fail(f"the torch generator's samples never arrived\n{run.cluster.dump_logs()}")
    run.finish()
    assert len(run.batches) >= 6  # one before each change, three with gen-b alone, one or more from gen-t
