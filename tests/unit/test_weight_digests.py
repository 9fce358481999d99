"""Bucket digests of a weights buffer (protocol 1.6): the hash, its bucket boundaries, the check a
member makes before loading, the announce's own checks, and what the broadcaster's planner
puts in every announce (the run's key prefix, one digest per bucket); and since 1.7 the hash
named by the announce (``digest_alg``: BLAKE2b-128 or BLAKE3-128), which the planner picks from
its members' protocol versions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import blake3
import msgspec
import pytest
import torch

from april_async.broadcaster.actor import _cannot_join
from april_async.broadcaster.config import BroadcasterConfig
from april_async.broadcaster.rounds import Hash, Keep, RoundPlanner, Send, StartCollective
from april_async.weights.flat import (
    DigestMismatch,
    UnknownDigestAlg,
    bucket_digests,
    buckets,
    check_digests,
    digest,
    flatten,
)
from april_async.wire import messages as m

ROOT = Path(__file__).resolve().parents[2]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------------
# The digest and its buckets


def test_digest_is_hex_blake2b_with_a_16_byte_digest():
    assert digest(b"abc") == _blake(b"abc")
    assert len(digest(b"")) == 32 and digest(b"") != digest(b"\0")


@pytest.mark.parametrize("num_bytes,bucket", [(10, 4), (8, 4), (3, 4), (1, 1), (4097, 1024)])
def test_one_digest_per_bucket_over_exactly_its_bytes(num_bytes, bucket):
    buf = _bytes(num_bytes)
    raw = buf.numpy().tobytes()
    expected = [_blake(raw[a:b]) for a, b in buckets(num_bytes, bucket)]
    assert bucket_digests(buf, bucket) == expected
    assert len(expected) == -(-num_bytes // bucket)


def test_an_empty_buffer_has_no_digests():
    assert bucket_digests(torch.empty(0, dtype=torch.uint8), 16) == []
    check_digests(torch.empty(0, dtype=torch.uint8), 16, [])


def test_a_read_only_view_of_a_received_frame_is_hashed_in_place():
    import numpy as np

    frame = np.frombuffer(bytes(range(40)), dtype=np.uint8)  # read-only, as a decoded bulk frame
    with pytest.warns(UserWarning):
        buf = torch.from_numpy(frame)
    assert bucket_digests(buf, 16) == [_blake(bytes(range(a, b))) for a, b in ((0, 16), (16, 32), (32, 40))]


def test_digests_refuse_a_buffer_that_is_not_flat_bytes():
    with pytest.raises(ValueError, match="1-D uint8"):
        bucket_digests(torch.zeros(4, dtype=torch.float32), 4)


# ---------------------------------------------------------------------------------------------
# The check


@pytest.mark.parametrize("flip,bucket", [(0, 0), (15, 0), (16, 1), (31, 1), (32, 2), (39, 2)])
def test_a_flipped_byte_is_caught_in_its_own_bucket(flip, bucket):
    sent = _bytes(40)
    digests = bucket_digests(sent, 16)
    received = sent.clone()
    received[flip] ^= 0x01
    with pytest.raises(DigestMismatch) as info:
        check_digests(received, 16, digests)
    e = info.value
    assert e.bucket == bucket and e.expected == digests[bucket]
    assert e.got == _blake(received.numpy().tobytes()[16 * bucket : 16 * bucket + 16])
    assert e.got != e.expected and f"bucket {bucket}" in str(e)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_digests_on_several_threads_are_those_of_one_in_bucket_order(monkeypatch, threads):
    from april_async.weights import flat

    buf = _bytes(10_000, seed=5)
    expected = [_blake(buf.numpy().tobytes()[a:b]) for a, b in buckets(10_000, 1024)]
    monkeypatch.setattr(flat, "_hash_threads", lambda buffer, bucket_bytes: threads)
    assert bucket_digests(buf, 1024) == expected
    check_digests(buf, 1024, expected)
    received = buf.clone()
    received[9000] ^= 0x01  # bucket 8 of 10
    with pytest.raises(DigestMismatch, match=r"bucket 8 \(bytes 8192:9216\)") as info:
        check_digests(received, 1024, expected)
    assert info.value.bucket == 8


def test_matching_bytes_pass_the_check():
    sent = _bytes(1000, seed=3)
    check_digests(sent.clone(), 64, bucket_digests(sent, 64))


def test_digests_of_another_bucket_size_do_not_pass():
    sent = _bytes(64)
    with pytest.raises(DigestMismatch, match="2 digests announced for the 4 buckets"):
        check_digests(sent, 16, bucket_digests(sent, 32))


@pytest.mark.parametrize("count", [0, 2, 4])
def test_a_wrong_number_of_digests_is_refused(count):
    sent = _bytes(40)
    digests = (bucket_digests(sent, 16) * 2)[:count]
    with pytest.raises(DigestMismatch, match=f"{count} digests announced for the 3 buckets") as info:
        check_digests(sent, 16, digests)
    assert info.value.bucket is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_a_cuda_buffer_is_hashed_bucket_by_bucket_on_the_host():
    host = _bytes(3 * 1024 + 5, seed=7)
    dev = host.cuda()
    assert bucket_digests(dev, 1024) == bucket_digests(host, 1024)
    dev[2000] ^= 0xFF
    with pytest.raises(DigestMismatch) as info:
        check_digests(dev, 1024, bucket_digests(host, 1024))
    assert info.value.bucket == 1


# ---------------------------------------------------------------------------------------------
# The announce


def _announce(**kw) -> m.WeightsAnnounce:
    fields = dict(version=1, group=m.GroupSpec(epoch=1, rank=1, world_size=2, store="127.0.0.1:1", backend="gloo"),
                  tensors=[], num_bytes=40, bucket_bytes=16)
    return m.WeightsAnnounce(**{**fields, **kw})


def test_an_announce_takes_no_digests_or_one_per_bucket():
    assert _announce().digests == []
    assert len(_announce(digests=bucket_digests(_bytes(40), 16)).digests) == 3
    with pytest.raises(ValueError, match="2 digests for 3 buckets"):
        _announce(digests=bucket_digests(_bytes(32), 16))


@pytest.mark.parametrize("bad", ["ABCDEF" * 5 + "ab", "0" * 31, "0" * 33, "g" * 32])
def test_an_announce_refuses_a_malformed_digest(bad):
    good = bucket_digests(_bytes(40), 16)
    with pytest.raises(ValueError, match=r"digests\[1\]"):
        _announce(digests=[good[0], bad, good[2]])


def test_the_decoder_refuses_a_wrong_digest_count_at_the_border():
    from april_async.wire import codec
    from april_async.wire.errors import WireError

    frames = codec.encode(_announce(digests=bucket_digests(_bytes(40), 16)), sender="broadcaster", seq=1)
    env = msgspec.msgpack.decode(frames[0])
    env["body"]["digests"] = env["body"]["digests"][:2]
    with pytest.raises(WireError) as info:
        codec.decode([msgspec.msgpack.encode(env), *frames[1:]])
    assert info.value.code == "malformed" and "2 digests for 3 buckets" in str(info.value)


def test_the_golden_vector_states_the_digests_of_its_bytes():
    """``weights_announce_verified`` names the buckets of the ``weights_update`` vector's bytes."""
    vectors = ROOT / "proto" / "vectors"
    update = json.loads((vectors / "weights_update.json").read_text())
    announce = json.loads((vectors / "weights_announce_verified.json").read_text())["envelope"]["body"]
    data = torch.tensor(update["bulk"]["$.body.data"], dtype=torch.uint8)
    assert announce["digests"] == bucket_digests(data, announce["bucket_bytes"])
    assert len(announce["group"]["key_prefix"]) == 32


# ---------------------------------------------------------------------------------------------
# The broadcaster's planner: what its announces carry

BUCKET = 64
CONFIG = BroadcasterConfig(timeout_s=2.0, bucket_mb=BUCKET / (1 << 20))


def _planner(key_prefix: str = "a" * 32) -> RoundPlanner:
    return RoundPlanner(CONFIG, backend="gloo", store="127.0.0.1:29600", epoch_id="e", key_prefix=key_prefix)


def _held(p: RoundPlanner, version: int, now: float, digests=None) -> tuple[torch.Tensor, list[str]]:
    specs, buf = flatten({"w": torch.arange(50, dtype=torch.float32) + version})  # 200 bytes: 4 buckets
    p.update("learner-0", version, specs, buf.numel(), None, now, digests=digests)
    return buf, bucket_digests(buf, BUCKET)


def _announces(effects) -> dict[str, m.WeightsAnnounce]:
    return {e.name: e.body for e in effects if isinstance(e, Send) and isinstance(e.body, m.WeightsAnnounce)}


def test_announces_carry_the_key_prefix_and_one_digest_per_bucket():
    p = _planner()
    p.hello("learner-0", "learner", 0, [], 0.0)
    for g in ("gen-0", "gen-1"):
        p.hello(g, "generator", 0, [], 0.0)
    buf, digests = _held(p, 1, 0.0)
    assert _announces(p.tick(0.1)) == {}, "a round must wait for the version's digests"
    p.digested(1, digests, 0.1)
    effects = p.tick(0.2)
    anns = _announces(effects)
    assert set(anns) == {"gen-0", "gen-1"}
    for ann in anns.values():
        assert ann.group.key_prefix == "a" * 32
        assert ann.digests == digests and len(ann.digests) == len(list(buckets(buf.numel(), BUCKET))) == 4
    root = next(e.root for e in effects if isinstance(e, StartCollective))
    assert root.rank == 0 and root.key_prefix == "a" * 32  # rank 0 keys its store the same way


def test_digests_of_a_replaced_version_are_ignored():
    p = _planner()
    p.hello("learner-0", "learner", 0, [], 0.0)
    p.hello("gen-0", "generator", 0, [], 0.0)
    _, old = _held(p, 1, 0.0)
    _, new = _held(p, 2, 0.0)
    assert p.digested(1, old, 0.1) == []
    assert _announces(p.tick(0.1)) == {}
    p.digested(2, new, 0.1)
    (ann,) = _announces(p.tick(0.2)).values()
    assert (ann.version, ann.digests) == (2, new)


def test_digests_of_the_wrong_count_are_a_bug():
    p = _planner()
    p.hello("learner-0", "learner", 0, [], 0.0)
    _, digests = _held(p, 1, 0.0)
    with pytest.raises(ValueError, match="3 digests for version 1, which has 4 buckets"):
        p.digested(1, digests[:3], 0.0)


@pytest.mark.parametrize("version,servers,refused", [("1.5", [], True), ("1.0", [], True), ("1.6", [], False),
                                                     ("1.12", [], False), ("1.5", ["http://s:1"], False)])
def test_a_generator_older_than_1_6_cannot_join_the_group(version, servers, refused):
    hello = m.Hello(role="generator", instance="gen-0", servers=servers)
    why = _cannot_join(hello, SimpleNamespace(proto_version=version))
    assert (why is not None) == refused
    if refused:
        assert version in why and "key_prefix" in why
    assert _cannot_join(m.Hello(role="learner", instance="l"), SimpleNamespace(proto_version="1.5")) is None


def test_one_version_flattened_twice_has_the_same_digests(monkeypatch):
    """The padding between tensors is zeroed, not left as the allocator's stray bytes (here made
    dirty on purpose: every new buffer starts full of 0xAB)."""
    real_empty = torch.empty

    def dirty_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(0xAB)

    monkeypatch.setattr(torch, "empty", dirty_empty)
    state = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(5, dtype=torch.float32)}  # 6 bytes, 2 of padding
    specs, first = flatten(state)
    assert specs[1].offset == 8 and first[6:8].tolist() == [0, 0]
    assert bucket_digests(first, 4) == bucket_digests(flatten(state)[1], 4)


# ---------------------------------------------------------------------------------------------
# The algorithm (protocol 1.7): BLAKE3-128 beside BLAKE2b-128

B2, B3 = m.BLAKE2B_128, m.BLAKE3_128


def _hash(data: bytes, alg: str) -> str:
    return _blake(data) if alg == B2 else blake3.blake3(data).hexdigest(16)


def test_blake3_128_is_the_first_16_bytes_of_blake3():
    """Known answers from the BLAKE3 reference (the empty input, ``abc``), cut to 16 bytes."""
    assert digest(b"", B3) == "af1349b9f5f9a1a6a0404dea36dcc949"
    assert digest(b"abc", B3) == "6437b3ac38465133ffb63b75273a8db5"
    assert digest(b"abc") == digest(b"abc", B2) == _blake(b"abc") != digest(b"abc", B3)


@pytest.mark.parametrize("alg", [B2, B3])
@pytest.mark.parametrize("threads", [1, 3])
def test_digests_round_trip_under_either_algorithm(monkeypatch, alg, threads):
    from april_async.weights import flat

    monkeypatch.setattr(flat, "_hash_threads", lambda buffer, bucket_bytes: threads)
    sent = _bytes(5000, seed=11)
    raw = sent.numpy().tobytes()
    digests = bucket_digests(sent, 1024, alg)
    assert digests == [_hash(raw[a:b], alg) for a, b in buckets(5000, 1024)]
    check_digests(sent.clone(), 1024, digests, alg)
    other = B3 if alg == B2 else B2
    with pytest.raises(DigestMismatch) as info:  # the right bytes, checked under the other hash
        check_digests(sent, 1024, digests, other)
    assert info.value.bucket == 0


@pytest.mark.parametrize("flip,bucket", [(0, 0), (16, 1), (39, 2)])
def test_a_tampered_bucket_is_refused_under_blake3_too(flip, bucket):
    sent = _bytes(40)
    digests = bucket_digests(sent, 16, B3)
    received = sent.clone()
    received[flip] ^= 0x80
    with pytest.raises(DigestMismatch) as info:
        check_digests(received, 16, digests, B3)
    e = info.value
    assert (e.bucket, e.expected) == (bucket, digests[bucket])
    assert e.got == _hash(received.numpy().tobytes()[16 * bucket : 16 * bucket + 16], B3)
    assert B3 in str(e)


@pytest.mark.parametrize("alg", ["sha256-128", "BLAKE3-128", ""])
def test_an_unknown_algorithm_is_refused_with_its_name(alg):
    sent = _bytes(40)
    with pytest.raises(UnknownDigestAlg) as info:
        check_digests(sent, 16, bucket_digests(sent, 16), alg)
    assert info.value.alg == alg and repr(alg) in str(info.value) and B3 in str(info.value)
    assert isinstance(info.value, DigestMismatch) and info.value.bucket is None  # refused as a mismatch is
    with pytest.raises(UnknownDigestAlg):
        bucket_digests(sent, 16, alg)
    with pytest.raises(UnknownDigestAlg):
        digest(b"", alg)


def test_an_unknown_algorithm_is_refused_before_anything_is_hashed(monkeypatch):
    from april_async.weights import flat

    monkeypatch.setattr(flat, "_digests", lambda *a: pytest.fail("hashed bytes it cannot check"))
    with pytest.raises(UnknownDigestAlg):
        check_digests(_bytes(40), 16, ["0" * 32] * 3, "md5")


def test_a_1_6_announce_reads_as_blake2b_and_a_blake3_one_round_trips():
    from april_async.wire import codec

    old = _announce(digests=bucket_digests(_bytes(40), 16))
    frames = codec.encode(old, sender="broadcaster", seq=1)
    body = msgspec.msgpack.decode(frames[0])["body"]
    assert "digest_alg" not in body, "the default is left out, as 1.6 sent it"
    assert codec.decode(frames).body.digest_alg == B2
    new = _announce(digests=bucket_digests(_bytes(40), 16, B3), digest_alg=B3)
    frames = codec.encode(new, sender="broadcaster", seq=2)
    assert msgspec.msgpack.decode(frames[0])["body"]["digest_alg"] == B3
    assert codec.decode(frames).body == new


def test_the_decoder_lets_an_unknown_algorithm_through_for_the_member_to_refuse():
    """A member must take part in the broadcast of an announce it cannot check (every rank must),
    so the border does not drop it: the member refuses the bytes (``UnknownDigestAlg``)."""
    from april_async.wire import codec

    frames = codec.encode(_announce(digests=bucket_digests(_bytes(40), 16), digest_alg="sha3-128"),
                          sender="broadcaster", seq=1)
    assert codec.decode(frames).body.digest_alg == "sha3-128"


def test_the_blake3_golden_vector_states_the_digests_of_its_bytes():
    vectors = ROOT / "proto" / "vectors"
    update = json.loads((vectors / "weights_update.json").read_text())
    announce = json.loads((vectors / "weights_announce_blake3.json").read_text())["envelope"]["body"]
    data = torch.tensor(update["bulk"]["$.body.data"], dtype=torch.uint8)
    assert announce["digest_alg"] == B3
    assert announce["digests"] == bucket_digests(data, announce["bucket_bytes"], B3)
    verified = json.loads((vectors / "weights_announce_verified.json").read_text())["envelope"]["body"]
    assert "digest_alg" not in verified and verified["digests"] != announce["digests"]


# ---------------------------------------------------------------------------------------------
# The planner picks the algorithm from its members' protocol versions

V16, V17 = (1, 6), (1, 7)


def _hashes(effects) -> list[Hash]:
    return [e for e in effects if isinstance(e, Hash)]


def _round(p: RoundPlanner, members: dict[str, tuple[int, int] | None], now: float = 0.0):
    """Hello from a learner and ``members`` (name -> protocol version), version 1 held, hashed as
    the planner asks; the announces of the round it starts."""
    p.hello("learner-0", "learner", 0, [], now)
    for g, proto in members.items():
        p.hello(g, "generator", 0, [], now, proto=proto)
    specs, buf = flatten({"w": torch.arange(50, dtype=torch.float32)})
    effects = p.update("learner-0", 1, specs, buf.numel(), None, now, digests=None)
    assert [type(e) for e in effects[:2]] == [Keep, Hash], "the bytes are kept, then hashed"
    (h,) = _hashes(effects)
    assert _announces(p.tick(now)) == {}, "a round waits for its digests"
    p.digested(1, bucket_digests(buf, BUCKET, h.digest_alg), now, h.digest_alg)
    return h.digest_alg, _announces(p.tick(now + 0.1)), buf


def test_members_all_of_1_7_get_blake3():
    alg, anns, buf = _round(_planner(), {"gen-0": V17, "gen-1": (1, 12)})
    assert alg == B3 and set(anns) == {"gen-0", "gen-1"}
    for ann in anns.values():
        assert ann.digest_alg == B3 and ann.digests == bucket_digests(buf, BUCKET, B3)


@pytest.mark.parametrize("protos", [{"gen-0": V16}, {"gen-0": V17, "gen-1": V16},
                                    {"gen-0": V17, "gen-1": None}])
def test_a_member_of_1_6_gets_blake2b_and_so_does_the_whole_round(protos):
    """An announce of one round names one algorithm: a single 1.6 member (or one whose version
    is not known) makes it BLAKE2b-128 for all."""
    alg, anns, buf = _round(_planner(), protos)
    assert alg == B2 and set(anns) == set(protos)
    for ann in anns.values():
        assert ann.digest_alg == B2 and ann.digests == bucket_digests(buf, BUCKET)


def test_a_member_on_sglang_servers_does_not_hold_the_group_back():
    """A generator on SGLang servers receives nothing over the group: its version does not count."""
    p = _planner()
    p.hello("gen-s", "generator", 0, ["http://s:1"], 0.0, proto=V16)
    alg, anns, _ = _round(p, {"gen-0": V17})
    assert alg == B3 and set(anns) == {"gen-0"}


def test_a_held_version_is_hashed_again_when_a_1_6_member_joins():
    p = _planner()
    p.hello("learner-0", "learner", 0, [], 0.0)
    p.hello("gen-0", "generator", 0, [], 0.0, proto=V17)
    specs, buf = flatten({"w": torch.arange(50, dtype=torch.float32)})
    (h,) = _hashes(p.update("learner-0", 1, specs, buf.numel(), None, 0.0, digests=None))
    assert h.digest_alg == B3
    p.hello("gen-old", "generator", 0, [], 0.0, proto=V16)  # joins while version 1 is being hashed
    effects = p.tick(0.1)
    assert _hashes(effects) == [Hash(1, B2)] and _announces(effects) == {}
    stale = bucket_digests(buf, BUCKET, B3)
    assert p.digested(1, stale, 0.1, B3) == [], "digests no longer wanted are ignored"
    assert _announces(p.tick(0.2)) == {} and _hashes(p.tick(0.2)) == [], "asked once; still waiting"
    p.digested(1, bucket_digests(buf, BUCKET, B2), 0.2, B2)
    anns = _announces(p.tick(0.3))
    assert {n: a.digest_alg for n, a in anns.items()} == {"gen-0": B2, "gen-old": B2}


def test_a_version_kept_with_no_member_is_hashed_with_blake2b_then_again_for_a_group_of_1_7():
    p = _planner()
    p.hello("learner-0", "learner", 0, [], 0.0)
    specs, buf = flatten({"w": torch.arange(50, dtype=torch.float32)})
    assert _hashes(p.update("learner-0", 1, specs, buf.numel(), None, 0.0, digests=None)) == [Hash(1, B2)]
    p.digested(1, bucket_digests(buf, BUCKET), 0.0)
    p.hello("gen-0", "generator", 0, [], 0.1, proto=V17)
    assert _hashes(p.tick(0.1)) == [Hash(1, B3)]
    p.digested(1, bucket_digests(buf, BUCKET, B3), 0.1, B3)
    (ann,) = _announces(p.tick(0.2)).values()
    assert ann.digest_alg == B3 and ann.digests == bucket_digests(buf, BUCKET, B3)
