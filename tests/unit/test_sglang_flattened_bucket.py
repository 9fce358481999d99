"""``broadcaster.sglang.packed_bucket``: a bucket of whole tensors in the layout SGLang's
``flattened_bucket`` receives (``weight_sync/tensor_bucket.py``): bytes back to back in the order
the call names them, each at an offset that is a multiple of its element size (0.5.23 refuses any
other before it posts the receive)."""

import torch

from april_async.broadcaster.sglang import packed_bucket
from april_async.weights.flat import DTYPES, flatten, unflatten


def sglang_views(order, packed):
    """What the server makes of the bytes (``FlattenedTensorBucket.empty`` and ``reconstruct_tensors``)."""
    out, offset = {}, 0
    for t in order:
        dtype = DTYPES[t.dtype]
        assert offset % dtype.itemsize == 0, (t.name, offset)  # 0.5.23 would refuse it
        size = torch.Size(t.shape).numel() * dtype.itemsize
        out[t.name] = packed[offset:offset + size].view(dtype).reshape(t.shape)
        offset += size
    assert offset == packed.numel()
    return out


def test_one_dtype_is_sent_from_the_buffer_itself():
    state = {"a": torch.randn(3, 5), "b": torch.randn(7), "c": torch.randn(2, 2)}
    specs, buffer = flatten(state)
    order, packed = packed_bucket(specs[1:], buffer)
    assert [t.name for t in order] == ["b", "c"]
    assert packed.data_ptr() == buffer.data_ptr() + specs[1].offset  # a view: no copy
    got = sglang_views(order, packed)
    assert all(torch.equal(got[n], state[n]) for n in ("b", "c"))


def test_mixed_dtypes_are_packed_larger_elements_first_so_every_offset_is_aligned():
    state = {"h": torch.randn(3).bfloat16(), "f": torch.randn(5), "g": torch.randn(1).half(), "k": torch.randn(2, 3)}
    specs, buffer = flatten(state)  # the wire's layout pads "f" to 8 after the 6 bytes of "h"
    order, packed = packed_bucket(specs, buffer)
    assert [t.name for t in order] == ["f", "k", "h", "g"]  # float32s, then the 2-byte ones, each in layout order
    got = sglang_views(order, packed)
    want = unflatten(specs, buffer)
    assert all(torch.equal(got[n], want[n]) for n in state)
