"""``WeightGroup.sever``: rank 0 gives up a collective or a rendezvous that waits on a member gone
dark, at once rather than after the group's ``timeout_s`` (issue 29: a 25 s network cut held a
round, every other member and the learner for the whole cut). Two ranks in this process, on
loopback, over the rendezvous store as the broadcaster hosts it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from april_async.weights.group import GroupError, WeightGroup
from april_async.wire import messages as m

TIMEOUT_S = 30.0
SEVER_AFTER_S = 1.0
PROMPT_S = 5.0  # well inside TIMEOUT_S


def spec(root: WeightGroup, epoch: int, rank: int) -> m.GroupSpec:
    return m.GroupSpec(epoch=epoch, rank=rank, world_size=2, store=root.store_address, backend="gloo",
                       timeout_s=TIMEOUT_S, key_prefix="k", rendezvous=root.rendezvous)


@pytest.fixture
def groups():
    root = WeightGroup.host("127.0.0.1", 0, TIMEOUT_S, rendezvous_port=0, allow_open=True)
    member = WeightGroup(address="127.0.0.1")
    yield root, member
    member.close()
    root.close()


def failing_within(call) -> tuple[float, BaseException | None]:
    """Run ``call`` on a thread, sever after SEVER_AFTER_S; (seconds the call took, what it raised)."""
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(SEVER_AFTER_S)
    return t, out


def test_a_broadcast_blocked_on_a_member_that_does_not_receive_fails_at_once_when_severed(groups):
    root, member = groups
    joins = [threading.Thread(target=g.join, args=(spec(root, 1, r),)) for r, g in ((0, root), (1, member))]
    for t in joins:
        t.start()
    for t in joins:
        t.join(TIMEOUT_S)
    assert root.epoch == 1 and member.epoch == 1
    big = torch.zeros(64 << 20, dtype=torch.uint8)  # more than the sockets' buffers hold: the send blocks
    t, out = failing_within(lambda: root.broadcast(big, 64 << 20, tag=1))  # the member posts no receive
    assert t.is_alive(), f"the broadcast ended without the member: {out}"
    cut = root.sever()
    t.join(PROMPT_S)
    assert not t.is_alive(), f"the broadcast still waits {PROMPT_S} s after sever()"
    assert cut >= 1 and isinstance(out.get("error"), GroupError), out
    assert out["s"] < SEVER_AFTER_S + PROMPT_S


def test_a_rendezvous_a_member_never_reaches_is_given_up_when_severed(groups):
    root, _ = groups
    t, out = failing_within(lambda: root.join(spec(root, 2, 0)))  # rank 1 never comes
    assert t.is_alive()
    root.sever()
    t.join(PROMPT_S)
    assert not t.is_alive(), f"the join still waits {PROMPT_S} s after sever()"
    assert isinstance(out.get("error"), GroupError) and "cancelled" in str(out["error"]), out
