"""The flat weight layout: round trips, views, and layouts that do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from april_async.weights.flat import DTYPES, buckets, check_layout, flatten, unflatten
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
    for name in a:
        assert b[name].dtype == a[name].dtype and b[name].shape == a[name].shape, name
        assert torch.equal(a[name], b[name]), name


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
    assert all(b == a2 for (_, b), (a2, _) in zip(ranges, ranges[1:]))


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
