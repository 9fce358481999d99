"""The flat weight layout: round trips, views, and layouts that do not fit."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from april_async.weights.flat import DTYPES, buckets, check_layout, flatten, layout, tensor_buckets, unflatten
from april_async.wire import messages as m
from april_async.wire.codec import decode, encode


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "layers.0.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "layers.0.attn.scale": torch.tensor(0.125),  # 0-d
        "layers.0.mlp.up": torch.randn(3, 5, generator=g).to(torch.float16),
        "empty": torch.empty(0, 4),
        "lm_head.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "tail": torch.randn(3, generator=g),  # float32 after an odd number of 16-bit values
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name, t in a.items():
        assert b[name].dtype == t.dtype and b[name].shape == t.shape, name
        assert torch.equal(t, b[name]), name


def test_round_trip_mixed_dtypes_returns_views():
    sd = _state()
    specs, buf = flatten(sd)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert [s.dtype for s in specs] == ["float32", "bfloat16", "float32", "float16", "float32", "bfloat16", "float32"]
    for s, t in zip(specs, sd.values()):
        assert s.offset % t.element_size() == 0  # aligned for a view
    out = unflatten(specs, buf)
    _same(sd, out)
    storage = buf.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in out.values())  # views, not copies
    buf.zero_()
    assert not out["embed.weight"].any()


def test_flatten_copies_and_packs_one_dtype_back_to_back():
    sd = {"a": torch.randn(3, 3), "b": torch.randn(4)}
    specs, buf = flatten(sd)
    assert [s.offset for s in specs] == [0, 36] and buf.numel() == 52
    sd["a"].zero_()  # the buffer is a copy
    assert unflatten(specs, buf)["a"].abs().sum() > 0


def test_bfloat16_round_trip_is_bit_exact():
    t = torch.randn(1000).to(torch.bfloat16)
    t[:4] = torch.tensor([float("inf"), -0.0, float("nan"), 1e-38])
    specs, buf = flatten({"w": t})
    back = unflatten(specs, buf)["w"]
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_non_contiguous_tensors_flatten():
    base = torch.randn(4, 6)
    sd = {"t": base.t(), "s": base[:, ::2]}
    specs, buf = flatten(sd)
    _same({k: v.contiguous() for k, v in sd.items()}, unflatten(specs, buf))


def test_round_trip_through_the_wire():
    sd = _state(3)
    specs, buf = flatten(sd)
    frames = encode(m.WeightsUpdate(version=4, tensors=specs, data=buf.numpy()), sender="learner-0", seq=1)
    msg = decode([bytes(f) for f in frames])
    data = torch.from_numpy(np.array(msg.body.data))  # the received view is read-only
    _same(sd, unflatten(msg.body.tensors, data))


def test_misaligned_offsets_from_another_packer_are_copied_out():
    sd = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2)}
    packed = torch.cat([sd["a"].view(torch.uint8), sd["b"].view(torch.uint8)])  # b at byte 6: no padding
    specs = [m.TensorSpec("a", "bfloat16", [3], 0), m.TensorSpec("b", "float32", [2], 6)]
    _same(sd, unflatten(specs, packed))


def test_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="'steps'.*torch.int64"):
        flatten({"w": torch.zeros(2), "steps": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="'w'.*'int8'"):
        unflatten([m.TensorSpec("w", "int8", [2], 0)], torch.zeros(8, dtype=torch.uint8))


@pytest.mark.parametrize("specs, size, match", [
    ([m.TensorSpec("w", "float32", [3, 4], 0)], 47, r"'w' float32\[3, 4\] at offset 0 ends at byte 48.*47-byte"),
    ([m.TensorSpec("a", "float32", [2], 0), m.TensorSpec("b", "float32", [2], 100)], 64, "'b'.*ends at byte 108"),
    ([m.TensorSpec("a", "float32", [4], 0), m.TensorSpec("b", "float16", [2], 12)], 64, "'b'.*overlaps tensor 'a'"),
    ([m.TensorSpec("a", "float32", [1], 0), m.TensorSpec("a", "float32", [1], 4)], 64, "'a' appears twice"),
])
def test_layouts_that_do_not_fit_name_the_tensor(specs, size, match):
    with pytest.raises(ValueError, match=match):
        check_layout(specs, size)
    with pytest.raises(ValueError, match=match):
        unflatten(specs, torch.zeros(size, dtype=torch.uint8))


def test_zero_sized_tensors_may_share_an_offset():
    specs = [m.TensorSpec("e", "float32", [0, 3], 4), m.TensorSpec("w", "float32", [1], 4)]
    out = unflatten(specs, torch.zeros(8, dtype=torch.uint8))
    assert out["e"].shape == (0, 3) and out["w"].shape == (1,)


def test_the_buffer_must_be_flat_bytes():
    with pytest.raises(ValueError, match="1-D uint8"):
        unflatten([], torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="1-D uint8"):
        unflatten([], torch.zeros(2, 2, dtype=torch.uint8))


@given(st.integers(0, 10_000), st.integers(1, 3000))
def test_buckets_cover_the_buffer_in_order(num_bytes, bucket_bytes):
    ranges = list(buckets(num_bytes, bucket_bytes))
    assert [a for a, _ in ranges] == list(range(0, num_bytes, bucket_bytes))
    assert all(0 < b - a <= bucket_bytes for a, b in ranges)
    assert sum(b - a for a, b in ranges) == num_bytes
    assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(ranges))


def test_buckets_refuse_a_zero_size():
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        list(buckets(10, 0))


@given(st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), max_size=3)), max_size=8))
def test_round_trip_any_layout(entries):
    g = torch.Generator().manual_seed(len(entries))
    sd = {f"t{i}": torch.randn(shape, generator=g).to(DTYPES[dt]) for i, (dt, shape) in enumerate(entries)}
    specs, buf = flatten(sd)
    check_layout(specs, buf.numel())
    _same(sd, unflatten(specs, buf))


# ---------------------------------------------------------------------------------------------
# layout and tensor_buckets: the parts of a hand-off


def test_layout_is_the_layout_flatten_makes():
    sd = _state(5)
    specs, buf = flatten(sd)
    assert layout((name, t.dtype, t.shape) for name, t in sd.items()) == (specs, buf.numel())


def test_layout_aligns_each_offset_to_its_dtype():
    specs, total = layout([("a", torch.bfloat16, (3,)), ("b", torch.float32, [2]), ("c", torch.float16, (5,)),
                           ("d", torch.float32, (0, 7)), ("e", torch.bfloat16, ())])
    assert [(s.name, s.dtype, s.shape, s.offset) for s in specs] == [
        ("a", "bfloat16", [3], 0), ("b", "float32", [2], 8), ("c", "float16", [5], 16), ("d", "float32", [0, 7], 28),
        ("e", "bfloat16", [], 28)]
    assert total == 30


def test_layout_refuses_a_dtype_by_name():
    with pytest.raises(ValueError, match="'steps'.*torch.int64"):
        layout([("w", torch.float32, (2,)), ("steps", torch.int64, (1,))])


def _specs(entries: list[tuple[str, list[int]]]) -> list[m.TensorSpec]:
    return layout((f"t{i}", DTYPES[dt], shape) for i, (dt, shape) in enumerate(entries))[0]


@pytest.mark.parametrize("entries, bucket, want", [
    # one dtype, 16 bytes each: two per bucket of 32
    ([("float32", [4])] * 5, 32, [(0, 32, [0, 1]), (32, 64, [2, 3]), (64, 80, [4])]),
    # a tensor bigger than a bucket stands alone; the small ones around it are grouped
    ([("float32", [1]), ("float32", [100]), ("float32", [1]), ("float32", [1])], 16,
     [(0, 4, [0]), (4, 404, [1]), (404, 412, [2, 3])]),
    # the padding before b (bytes 6..8) belongs to b's range
    ([("bfloat16", [3]), ("float32", [2]), ("float16", [5])], 8, [(0, 6, [0]), (6, 16, [1]), (16, 26, [2])]),
    ([("bfloat16", [3]), ("float32", [2]), ("float16", [5])], 16, [(0, 16, [0, 1]), (16, 26, [2])]),
    ([("bfloat16", [3]), ("float32", [2]), ("float16", [5])], 26, [(0, 26, [0, 1, 2])]),
    # empty tensors go with the range they sit in
    ([("float32", [0]), ("float32", [2]), ("float32", [0, 3]), ("float32", [2])], 8,
     [(0, 8, [0, 1, 2]), (8, 16, [3])]),
    ([], 8, []),
])
def test_tensor_buckets_cases(entries, bucket, want):
    assert tensor_buckets(_specs(entries), bucket) == want


def test_tensor_buckets_refuse_a_zero_size():
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        tensor_buckets(_specs([("float32", [1])]), 0)


@given(st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 6), max_size=3)), max_size=12),
       st.integers(1, 400))
def test_tensor_buckets_cut_whole_tensors_greedily(entries, bucket):
    specs = _specs(entries)
    total = layout((f"t{i}", DTYPES[dt], shape) for i, (dt, shape) in enumerate(entries))[1]
    ranges = tensor_buckets(specs, bucket)
    # consecutive ranges covering [0, total), every tensor in exactly one, wholly inside it
    assert [a for a, _, _ in ranges] == [0, *(b for _, b, _ in ranges[:-1])][: len(ranges)]
    assert (ranges[-1][1] if ranges else 0) == total
    assert sorted(i for _, _, idx in ranges for i in idx) == list(range(len(specs)))
    for start, stop, idx in ranges:
        assert idx and start <= stop
        for i in idx:
            s = specs[i]
            assert start <= s.offset and s.offset + math.prod(s.shape) * DTYPES[s.dtype].itemsize <= stop
        if len(idx) > 1:
            assert stop - start <= bucket
        if stop > start:  # a range ends where its last tensor ends
            assert max(specs[i].offset + math.prod(specs[i].shape) * DTYPES[specs[i].dtype].itemsize
                       for i in idx) == stop
    # greedy: the next range's first tensor would not have fitted in the range before
    for (start, _, _), (_, _, nxt) in itertools.pairwise(ranges):
        s = specs[nxt[0]]
        assert s.offset + math.prod(s.shape) * DTYPES[s.dtype].itemsize - start > bucket


def test_tensor_buckets_cut_a_real_state_dict_into_parts_that_rebuild_it():
    sd = _state(7)
    specs, buf = flatten(sd)
    ranges = tensor_buckets(specs, 40)
    assert len(ranges) > 2
    rebuilt = torch.cat([buf[a:b] for a, b, _ in ranges])
    assert torch.equal(rebuilt, buf)


def test_flatten_reuses_a_buffer_of_the_layouts_size_and_zeroes_its_padding():
    sd = {"a": torch.randn(3, dtype=torch.float16), "b": torch.randn(2)}  # 2 bytes of padding at 6:8
    specs, first = flatten(sd)
    first.fill_(0xFF)  # what a version before left behind
    again, buf = flatten(sd, out=first)
    assert buf is first and again == specs
    assert not buf[6:8].any(), "stale padding would change the bucket digests"
    _same(sd, unflatten(specs, buf))
    for other in (torch.empty(first.numel() + 1, dtype=torch.uint8), torch.empty(3, dtype=torch.float32)):
        assert flatten(sd, out=other)[1] is not other  # the wrong size or dtype: a new buffer
