"""``subscriber.BufferPool``: a version is received into the buffer of the one before when that
has its size and device and nothing reads it any more."""

from __future__ import annotations

import torch

from april_async.weights.subscriber import BufferPool

CPU = torch.device("cpu")


def test_a_given_back_buffer_is_taken_again_for_the_same_size_only():
    pool = BufferPool()
    a = pool.take(64, CPU)
    assert a.dtype == torch.uint8 and a.shape == (64,)
    pool.give(a)
    assert pool.take(64, CPU) is a
    assert pool.take(64, CPU) is not a  # taken already: nothing free
    pool.give(a)
    b = pool.take(128, CPU)
    assert b is not a and b.numel() == 128


def test_a_buffer_still_loaded_from_is_never_handed_out():
    pool = BufferPool()
    a = pool.take(64, CPU)  # version 1: its receipt waits to be loaded
    b = pool.take(64, CPU)  # version 2 arrives meanwhile
    assert b is not a
    pool.give(a)
    pool.give(b)  # keep=1: only the last one given back stays
    assert pool.take(64, CPU) is b and pool.take(64, CPU) is not a
