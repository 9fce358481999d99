"""``standins/nccl_semantics.py``: gloo under NCCL's host-side semantics, held to what torch's
``ProcessGroupNCCL`` does on the host (its collectives are queued on a CUDA stream; ``wait`` orders
the caller's stream and returns; a watchdog ends a collective not done by the group's timeout;
``abort`` ends what is queued; ``shutdown``, what ``destroy_process_group`` calls, waits for it).
Rank 1 is a real second process that receives, or never posts its receive."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from april_async.testing.procs import free_port
from april_async.weights.custom_group import join_custom_group, leave_custom_group
from standins import nccl_semantics

ROOT = Path(__file__).resolve().parents[2]
RANK1 = """
import sys, time, torch, torch.distributed as dist
from april_async.weights.custom_group import join_custom_group
from standins import nccl_semantics
nccl_semantics.register()
port, name, receive = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
print("imported", flush=True)
pg = join_custom_group(backend=nccl_semantics.BACKEND, world_size=2, rank=1, group_name=name, timeout_s=2,
                       init_method=f"tcp://127.0.0.1:{port}")
if receive:
    t = torch.zeros(4)
    dist.broadcast(t, src=0, group=pg)
    print(t.tolist(), flush=True)
time.sleep(4)
"""


def group(name: str, receive: bool):
    nccl_semantics.register()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=20),
                          wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", RANK1, str(port), name, "1" if receive else "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    # The group's 2 s rendezvous starts once the peer has imported torch (about 2 s of its own here).
    assert peer.stdout.readline().strip() == "imported"
    pg = join_custom_group(backend=nccl_semantics.BACKEND, world_size=2, rank=0, group_name=name, timeout_s=2,
                           store=store)
    return pg, peer, store


def test_a_received_broadcast_completes_and_the_receiver_gets_the_data():
    pg, peer, _store = group("nccl-sem-ok", receive=True)
    try:
        work = dist.broadcast(torch.arange(4.0), src=0, group=pg, async_op=True)
        deadline = time.monotonic() + 10
        while not work.is_completed():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert work.is_success()
        assert peer.stdout.readline().strip() == "[0.0, 1.0, 2.0, 3.0]"
    finally:
        leave_custom_group(pg)
        peer.kill()


@pytest.mark.parametrize("end", ["watchdog", "abort", "shutdown"])
def test_a_broadcast_nobody_receives_returns_and_only_the_watchdog_or_an_abort_ends_it(end):
    before = len(nccl_semantics.WATCHDOG)
    pg, peer, _store = group(f"nccl-sem-{end}", receive=False)
    try:
        t0 = time.monotonic()
        dist.broadcast(torch.arange(4.0), src=0, group=pg)  # NCCL: queued, the call returns
        assert time.monotonic() - t0 < 0.5
        if end == "abort":
            pg.abort()  # ncclCommAbort: nothing is left for the watchdog
            time.sleep(2.5)
            assert nccl_semantics.WATCHDOG[before:] == []
        elif end == "shutdown":  # destroy_process_group: graceful, it waits for the queued broadcast
            t0 = time.monotonic()
            leave_custom_group(pg)
            assert 1.5 < time.monotonic() - t0 < 5 and len(nccl_semantics.WATCHDOG) == before + 1
        else:
            time.sleep(2.5)
            assert len(nccl_semantics.WATCHDOG) == before + 1
            assert "not done after 2 s" in nccl_semantics.WATCHDOG[-1]
            with pytest.raises(RuntimeError, match="broken communicator"):
                dist.broadcast(torch.arange(4.0), src=0, group=pg)
    finally:
        leave_custom_group(pg)
        peer.kill()
