"""Shared-memory regions of the hand-off (``weights.shm``, protocol 1.7) and the learner's use of
them (``WeightHandoff`` against a scripted broadcaster session): export / open / release, the
checks a reader makes, stale names, and which region each version goes into."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from april_async.testing.weights import policy
from april_async.weights import shm
from april_async.weights.flat import flatten
from april_async.weights.handoff import BroadcastRefused, WeightHandoff
from april_async.wire import messages as m
from april_async.wire.codec import decode, encode

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm on this host")


def _names(instance: str) -> set[str]:
    return {p.name for p in shm.SHM_DIR.iterdir() if p.name.startswith(f"april-w-{shm._safe(instance)}-")}


@pytest.fixture
def region():
    r = shm.ShmRegion.create("unit-shm", 1000)
    yield r
    r.close()


def test_an_exported_region_opens_elsewhere_with_the_same_bytes(region):
    region.begin_write()
    region.data[:] = np.arange(1000) % 251
    handle = region.export(7)
    assert (handle.kind, handle.nbytes, handle.generation, handle.offset) == ("posix_shm", 1000, 1, shm.HEADER_BYTES)
    mapped = shm.open_region(handle)
    assert mapped.array.tobytes() == region.data.tobytes()
    assert mapped.header()[1:] == (1, 1000, 7)
    region.data[0] = 250  # one mapping: the reader sees the owner's writes
    assert mapped.array[0] == 250 and mapped.still_valid()
    region.begin_write()  # the owner starts the next version: the reader's handle no longer holds
    assert not mapped.still_valid()
    mapped.release()


def test_a_reader_refuses_a_handle_that_does_not_match_the_region(region):
    good = region.export(1)
    cases = [
        (m.SharedRegion(kind="cuda_ipc", name=good.name, offset=good.offset, nbytes=1000, generation=1), "kind"),
        (m.SharedRegion(kind="posix_shm", name="../../etc/passwd", offset=4096, nbytes=10, generation=1), "form"),
        (m.SharedRegion(kind="posix_shm", name="april-w-nobody-1-1", offset=4096, nbytes=10, generation=1),
         "cannot open"),
        (m.SharedRegion(kind="posix_shm", name=good.name, offset=good.offset, nbytes=1000, generation=2),
         "generation 1"),
        (m.SharedRegion(kind="posix_shm", name=good.name, offset=good.offset, nbytes=5000, generation=1), "bytes"),
        (m.SharedRegion(kind="posix_shm", name=good.name, offset=0, nbytes=1000, generation=1), "bytes"),
    ]
    for handle, why in cases:
        with pytest.raises(shm.RegionError, match=why):
            shm.open_region(handle)


def test_close_unlinks_and_unlink_is_idempotent():
    r = shm.ShmRegion.create("unit-close", 64)
    assert r.name in _names("unit-close")
    handle = r.export(1)
    mapped = shm.open_region(handle)
    r.unlink()
    r.unlink()
    assert r.name not in _names("unit-close")
    assert mapped.still_valid() and mapped.array.nbytes == 64  # a mapping outlives the name
    r.close()
    assert not _names("unit-close")


def test_a_region_larger_than_the_tmpfs_is_a_region_error_not_a_crash():
    """Refused before a byte is allocated: filling a tmpfs to find out takes the host's memory."""
    free = os.statvfs(shm.SHM_DIR)
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises(shm.RegionError, match="cannot allocate .* only .* bytes are free"):
        shm.ShmRegion.create("unit-big", too_big)
    assert not _names("unit-big")
    assert os.statvfs(shm.SHM_DIR).f_bavail >= free.f_bavail - 1024  # nothing was taken on the way


def test_remove_stale_takes_the_names_of_dead_processes_only(region):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = shm.SHM_DIR / f"april-w-unit_shm-{int(dead.stdout)}-1"
    stale.write_bytes(b"x")
    other = shm.SHM_DIR / f"april-w-unit_shmother-{int(dead.stdout)}-1"  # another instance's: not ours
    other.write_bytes(b"x")
    try:
        assert shm.remove_stale("unit-shm") == [stale.name]
        assert region.name in _names("unit-shm")  # this process's, alive
        assert other.exists()
    finally:
        stale.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_an_update_in_a_region_encodes_decodes_and_is_one_empty_part():
    handle = m.SharedRegion(kind="posix_shm", name="april-w-l-1-1", offset=4096, nbytes=24, generation=3)
    spec = [m.TensorSpec("w", "float32", [6], 0)]
    body = m.WeightsUpdate(version=5, tensors=spec, data=np.empty(0, np.uint8), region=handle)
    frames = encode(body, sender="learner-0", seq=1)
    assert decode([bytes(f) for f in frames]).body.region == handle
    hb = decode([bytes(f) for f in encode(m.Heartbeat(policy_version=5, regions=[handle]), sender="b", seq=2)])
    assert hb.body.regions == [handle]
    with pytest.raises(ValueError, match="one part with empty data"):
        m.WeightsUpdate(version=5, tensors=spec, data=np.zeros(24, np.uint8), region=handle)
    with pytest.raises(ValueError, match="one part"):
        m.WeightsUpdate(version=5, tensors=spec, data=np.empty(0, np.uint8), region=handle, parts=2)
    with pytest.raises(ValueError, match="generation"):
        m.SharedRegion(kind="posix_shm", name="x", offset=0, nbytes=1, generation=0)


# ---------------------------------------------------------------------------------------------
# The learner's side, against a scripted session


class Session:
    """A broadcaster session stand-in: ``inbox`` holds what the broadcaster says, ``sent`` what was sent."""

    def __init__(self, on_connect):
        self.inbox, self.sent = [], []
        self.last_tracker = None
        self.link = SimpleNamespace(peer_timeout_s=1.0)
        on_connect(self)

    def send(self, body, parent_id=None, *, track=False):
        self.sent.append(body)

    def poll(self, timeout_s):
        return SimpleNamespace(body=self.inbox.pop(0), proto_version="1.6") if self.inbox else None

    def close(self):
        pass


def welcome(host_id, epoch="e1"):
    return m.Welcome(broker_epoch=epoch, policy_version=0, heartbeat_interval_s=1.0, peer_timeout_s=5.0,
                     max_message_bytes=1 << 30, host_id=host_id)


def _handoff(mode="auto"):
    state = {"v": 0}
    h = WeightHandoff("unit-learner", Session, lambda: (state["v"], policy(state["v"])), mode=mode)
    return h, state


def _updates(h):
    return [b for b in h.peer.sent if isinstance(b, m.WeightsUpdate)]


def test_versions_alternate_between_two_regions_and_go_as_bytes_when_none_is_free():
    h, state = _handoff()
    try:
        h.peer.inbox.append(welcome(shm.host_id()))
        h.pump()
        for v in (1, 2, 3):
            state["v"] = v
            h.send(v, policy(v))
        ups = _updates(h)
        assert [u.region is not None for u in ups] == [True, True, False]  # both regions busy: bytes
        assert ups[0].region.name != ups[1].region.name and h.shm_fallbacks == 1
        for u in ups[:2]:  # the region holds exactly the version's flat bytes
            mapped = shm.open_region(u.region)
            assert mapped.array.tobytes() == flatten(policy(u.version))[1].numpy().tobytes()
        # the broadcaster reads version 2's region only: version 1's is free, and 2's name goes
        h.peer.inbox.append(m.Heartbeat(policy_version=2, regions=[ups[1].region]))
        h.pump()
        assert ups[1].region.name not in _names("unit-learner")
        state["v"] = 4
        h.send(4, policy(4))
        last = _updates(h)[-1]
        assert last.region is not None and last.region.name == ups[0].region.name and last.region.generation == 2
        # an older heartbeat (held version 3 < 4) does not free version 4's region
        h.peer.inbox.append(m.Heartbeat(policy_version=3, regions=[]))
        h.pump()
        assert [s.busy for s in h._slots] == [True, False]
    finally:
        h.close()
    assert not _names("unit-learner")


@pytest.mark.parametrize("mode, host, expect", [("auto", "another-host/1", False), ("shm", "another-host/1", True),
                                                 ("zmq", "same", False), ("auto", None, False)])
def test_which_hand_off_a_welcome_allows(mode, host, expect):
    h, state = _handoff(mode)
    try:
        h.peer.inbox.append(welcome(shm.host_id() if host == "same" else host))
        h.pump()
        state["v"] = 1
        h.send(1, policy(1))
        assert (_updates(h)[-1].region is not None) is expect
        assert h.last_mode == ("shm" if expect else "zmq")
    finally:
        h.close()


def test_region_unavailable_turns_shm_off_and_resends_the_version_as_bytes():
    h, state = _handoff()
    try:
        h.peer.inbox.append(welcome(shm.host_id()))
        h.pump()
        state["v"] = 1
        h.send(1, policy(1))
        assert _updates(h)[-1].region is not None
        h.peer.inbox.append(m.Error(code="region_unavailable", message="cannot open it", field="$.body.region"))
        h.pump()
        resent = _updates(h)[-1]
        assert resent.region is None and resent.version == 1 and len(resent.data) > 0
        assert h.shm_off == "cannot open it" and not _names("unit-learner")
        h.send(2, policy(2))
        assert _updates(h)[-1].region is None  # off until the next session
    finally:
        h.close()


def test_a_new_broadcaster_process_frees_every_region_and_parts_go_in_place():
    h, state = _handoff()
    try:
        h.peer.inbox.append(welcome(shm.host_id(), "e1"))
        h.pump()
        h.send(1, policy(1))
        h.send(2, policy(2))
        h.peer.inbox.append(welcome(shm.host_id(), "e2"))  # a restarted broadcaster: reads nothing of ours
        h.pump()
        assert not h._slots and not _names("unit-learner")
        specs, buf = flatten(policy(3))
        data = buf.numpy()
        half = len(data) // 2
        in_place = []

        def parts():
            for start, stop in ((0, half), (half, len(data))):
                target = h.part_target(start, stop)
                in_place.append(target is not None)
                target[:] = data[start:stop]
                yield start, target

        h.send_parts(3, specs, len(data), parts(), 2)
        up = _updates(h)[-1]
        assert in_place == [True, True] and up.region is not None
        assert shm.open_region(up.region).array.tobytes() == data.tobytes()
    finally:
        h.close()
    assert not _names("unit-learner")


# ---------------------------------------------------------------------------------------------
# LoRA adapter versions (protocol 1.10): carried by every way of handing a version over

ADAPTER = m.AdapterSpec(base_digest="blake3-128:" + "5a" * 16, rank=2, alpha=4.0, target_modules=["q_proj"])


def lora(version: int) -> dict:
    """A rank-2 adapter of layer 0's q_proj (a 16x16 weight), different for every version."""
    g = torch.Generator().manual_seed(version)
    return {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 16, generator=g),
            "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 2, generator=g)}


def _parts(version: int, k: int = 2):
    specs, buf = flatten(lora(version))
    data = buf.numpy()
    cut = len(data) // k
    ends = [(i + 1) * cut for i in range(k - 1)] + [len(data)]
    return specs, len(data), [(i * cut, data[i * cut:end]) for i, end in enumerate(ends)]


def test_an_adapter_rides_on_part_zero_by_bytes_and_a_full_version_carries_none():
    h, state = _handoff(mode="zmq")
    try:
        h.send(1, lora(1), adapter=ADAPTER)
        specs, total, parts = _parts(2, k=3)
        h.send_parts(2, specs, total, parts, 3, adapter=ADAPTER)
        h.send(3, policy(3))  # full weights, as before 1.10
        ups = _updates(h)
        assert [(u.version, u.part, u.adapter) for u in ups] == [
            (1, 0, ADAPTER), (2, 0, ADAPTER), (2, 1, None), (2, 2, None), (3, 0, None)]
        for u in ups:  # and each goes on the wire as it is (a later part with an adapter would not encode)
            assert decode([bytes(f) for f in encode(u, sender="learner-0", seq=1)]).body.adapter == u.adapter
    finally:
        h.close()


def test_an_adapter_rides_on_the_update_that_names_a_region():
    h, state = _handoff()
    try:
        h.peer.inbox.append(welcome(shm.host_id()))
        h.pump()
        h.peer_proto = "1.10"  # the stand-in's messages say 1.6
        h.send(1, lora(1), adapter=ADAPTER)
        specs, total, parts = _parts(2)
        h.send_parts(2, specs, total, parts, 2, adapter=ADAPTER)
        ups = _updates(h)
        assert [(u.version, u.region is not None, u.adapter) for u in ups] == [(1, True, ADAPTER),
                                                                               (2, True, ADAPTER)]
        assert shm.open_region(ups[1].region).array.tobytes() == flatten(lora(2))[1].numpy().tobytes()
    finally:
        h.close()


@pytest.mark.parametrize("names_it", [False, True], ids=["remembered", "from-current"])
def test_a_restarted_broadcaster_gets_the_current_adapter_version_again_as_an_adapter(names_it):
    """A new session hands the current version over again: with the adapter ``current()`` names, or,
    when it names none, the one that version was last handed over with."""
    state = {"v": 0}

    def current():
        return (state["v"], lora(state["v"]), ADAPTER) if names_it else (state["v"], lora(state["v"]))

    h = WeightHandoff("unit-learner", Session, current, mode="zmq")
    try:
        state["v"] = 4
        h.send(4, lora(4), adapter=ADAPTER)
        h._on_connect(h.peer)  # a second session: the broadcaster restarted
        resent = _updates(h)[-1]
        assert (resent.version, resent.adapter, len(_updates(h))) == (4, ADAPTER, 2)
        assert resent.data.tobytes() == flatten(lora(4))[1].numpy().tobytes()
        if not names_it:  # a full version handed over after it is re-sent as full weights
            state["v"] = 5
            h.send(5, policy(5))
            h._on_connect(h.peer)
            assert (_updates(h)[-1].version, _updates(h)[-1].adapter) == (5, None)
    finally:
        h.close()


def test_no_adapter_goes_to_a_broadcaster_older_than_1_10():
    h, state = _handoff(mode="zmq")
    try:
        h.peer.inbox.append(welcome(None))
        h.pump()  # the stand-in speaks 1.6
        why = r"protocol 1\.6: version 1 is a LoRA adapter, which needs 1\.10"
        with pytest.raises(BroadcastRefused, match=why):
            h.send(1, lora(1), adapter=ADAPTER)
        specs, total, parts = _parts(1)
        with pytest.raises(BroadcastRefused, match="1.10 or newer"):
            h.send_parts(1, specs, total, parts, 2, adapter=ADAPTER)
        assert not _updates(h)
        h.send(1, policy(1))  # full weights still go
        assert _updates(h)[-1].adapter is None
    finally:
        h.close()
